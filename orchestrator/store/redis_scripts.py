"""The Redis side of `RedisStore`: where each record lives and the Lua scripts that change them.

Layout (every key under `{namespace}:`; every value JSON, never pickle)::

    {ns}:jobs                              set of job ids
    {ns}:job:{job_id}                      hash, one JSON value per JobRecord field
    {ns}:job:{job_id}:ledger               list of LedgerEntry JSON, in append order
    {ns}:job:{job_id}:ledger-index         hash "{instance_id}@{start_s}" -> sha1 of the entry JSON
    {ns}:job:{job_id}:events               stream, one field "event" = Event JSON
    {ns}:job:{job_id}:prices|training      streams, one field "r" = PriceSnapshot or
                                           TrainingReport JSON (the dashboard's series)
    {ns}:job:{job_id}:instances[:alive]    sets of instance ids
    {ns}:instances[:alive]                 sets of instance ids, all jobs
    {ns}:instance:{instance_id}            hash, one JSON value per InstanceRecord field
    {ns}:training-ports                    hash job id -> port of its hosted AgileML controller
    {ns}:claim:{key}                       string: the claim's owner (JSON), with a TTL

Each script runs atomically. Redis does not roll a script back if a command in it fails, so each
one checks everything first and does its writes last, the one most likely to fail (a type error
on a corrupted key) first. Each script replies with a status word first (`ok`, `missing`, ...),
then, where the caller needs it, the record's hash as field, value, ...
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from redis.commands.core import Script

from orchestrator.store.checks import check_id


@dataclass(frozen=True)
class RedisKeys:
    """The keys of one namespace (see the module docstring).

    The job and instance keys check their id first (`check_id`): an id that could not have
    been stored raises `NotFoundError` and never reaches a key.
    """

    namespace: str

    def key(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    def jobs(self) -> str:
        return self.key("jobs")

    def job(self, job_id: str) -> str:
        return self.key("job", check_id("job", job_id))

    def job_part(self, job_id: str, *parts: str) -> str:
        """A key of the job's: `ledger`, `ledger-index`, `events`, `prices`, `instances`, ..."""
        return self.key("job", check_id("job", job_id), *parts)

    def instances(self, job_id: str | None = None, *, alive_only: bool = False) -> str:
        """The index of one job's instances (or of all jobs'), or of the alive ones only."""
        base = ("instances",) if job_id is None else ("job", check_id("job", job_id), "instances")
        return self.key(*base, "alive") if alive_only else self.key(*base)

    def instance(self, instance_id: str) -> str:
        return self.key("instance", check_id("instance", instance_id))

    def training_ports(self) -> str:
        return self.key("training-ports")

    def claim(self, key: str) -> str:
        return self.key("claim", key)

    def clock(self) -> str:
        return self.key("clock-high-water")

    def controller_id(self) -> str:
        return self.key("controller-id")

    def lease(self) -> str:
        return self.key("lease")

    def lease_fence(self) -> str:
        return self.key("lease-fence")


# KEYS: job hash, jobs index. ARGV: job id, then field, value, ...
CREATE_JOB_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {'exists', redis.call('HGET', KEYS[1], 'version')}
end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('SADD', KEYS[2], ARGV[1])
return {'ok'}
"""

# KEYS: job hash. ARGV: expected version, state, updated_at, message, then the allowed sources.
TRANSITION_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local version = redis.call('HGET', KEYS[1], 'version')
local state = redis.call('HGET', KEYS[1], 'state')
if version ~= ARGV[1] then return {'conflict', version, state} end
local allowed = false
for i = 5, #ARGV do
  if ARGV[i] == state then allowed = true end
end
if not allowed then return {'illegal', version, state} end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'version', tostring(tonumber(version) + 1),
           'updated_at', ARGV[3], 'message', ARGV[4])
local out = redis.call('HGETALL', KEYS[1])
table.insert(out, 1, 'ok')
return out
"""

# KEYS: job hash. ARGV: work done, updated_at, then the terminal states (as stored): an ended
# job's numbers are frozen.
UPDATE_PROGRESS_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local state = redis.call('HGET', KEYS[1], 'state')
local ended = false
for i = 3, #ARGV do if state == ARGV[i] then ended = true end end
if not ended then
  redis.call('HSET', KEYS[1], 'work_done_gpu_hours', ARGV[1], 'updated_at', ARGV[2])
end
local out = redis.call('HGETALL', KEYS[1])
table.insert(out, 1, 'ok')
return out
"""

# KEYS: job hash, ledger list, ledger index. ARGV: identity, entry JSON, charge.
APPEND_LEDGER_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local digest = '"' .. redis.sha1hex(ARGV[2]) .. '"'  -- a JSON string, like every value
local seen = redis.call('HGET', KEYS[3], ARGV[1])
if seen then
  if seen == digest then return {'duplicate'} end
  return {'different'}
end
redis.call('HINCRBYFLOAT', KEYS[1], 'spent_usd', ARGV[3])
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], digest)
return {'ok'}
"""

# KEYS: instance hash, all index, all-alive index, job index, job-alive index.
# ARGV: instance id, encoded job id, '1' if alive else '0', then field, value, ...
PUT_INSTANCE_LUA = """
local job = redis.call('HGET', KEYS[1], 'job_id')
if job and job ~= ARGV[2] then return {'other_job', job} end
local ended = redis.call('HGET', KEYS[1], 'ended_at')
if ended and ended ~= 'null' and ARGV[3] == '1' then
  return {'ended', redis.call('HGET', KEYS[1], 'state')}
end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[1])
if ARGV[3] == '1' then
  redis.call('SADD', KEYS[3], ARGV[1])
  redis.call('SADD', KEYS[5], ARGV[1])
else
  redis.call('SREM', KEYS[3], ARGV[1])
  redis.call('SREM', KEYS[5], ARGV[1])
end
return {'ok'}
"""

# KEYS: instance hash, all-alive index, job-alive index, then the instance's job: its hash,
# ledger and ledger index.
# ARGV: instance id, ended_at, end_reason, state, then per charge of the bill: identity,
# entry JSON, charged (as APPEND_LEDGER_LUA). Every charge is checked before anything is
# written; the bill and the end land together or not at all.
END_INSTANCE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local status = 'already'
if redis.call('HGET', KEYS[1], 'ended_at') == 'null' then
  local charges = (#ARGV - 4) / 3
  if charges > 0 and redis.call('EXISTS', KEYS[4]) == 0 then return {'missing_job'} end
  local digests = {}
  for i = 0, charges - 1 do
    local identity, entry = ARGV[5 + 3 * i], ARGV[6 + 3 * i]
    digests[i] = '"' .. redis.sha1hex(entry) .. '"'  -- a JSON string, like every value
    local seen = redis.call('HGET', KEYS[6], identity)
    if seen and seen ~= digests[i] then return {'different', identity} end
  end
  for i = 0, charges - 1 do
    local identity = ARGV[5 + 3 * i]
    if not redis.call('HGET', KEYS[6], identity) then
      redis.call('HINCRBYFLOAT', KEYS[4], 'spent_usd', ARGV[7 + 3 * i])
      redis.call('RPUSH', KEYS[5], ARGV[6 + 3 * i])
      redis.call('HSET', KEYS[6], identity, digests[i])
    end
  end
  redis.call('HSET', KEYS[1], 'ended_at', ARGV[2], 'end_reason', ARGV[3], 'state', ARGV[4])
  redis.call('SREM', KEYS[2], ARGV[1])
  redis.call('SREM', KEYS[3], ARGV[1])
  status = 'ok'
end
local out = redis.call('HGETALL', KEYS[1])
table.insert(out, 1, status)
return out
"""

# KEYS: claim. ARGV: owner.
RELEASE_CLAIM_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


# KEYS: the mark. ARGV: now (a float's repr). Returns the mark after, as a string.
ADVANCE_CLOCK_LUA = """
local mark = redis.call('GET', KEYS[1])
if not mark or tonumber(mark) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
  return ARGV[1]
end
return mark
"""


# KEYS: lease, fence counter. ARGV: owner, ttl (ms). The lease holds {owner, token} as JSON.
# Returns the token, or false while another owner holds it.
ACQUIRE_LEASE_LUA = """
local held = redis.call('GET', KEYS[1])
if held then
  local lease = cjson.decode(held)
  if lease['owner'] ~= ARGV[1] then return false end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return lease['token']
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], cjson.encode({owner = ARGV[1], token = token}), 'PX', ARGV[2])
return token
"""

# KEYS: lease. ARGV: owner.
RELEASE_LEASE_LUA = """
local held = redis.call('GET', KEYS[1])
if held and cjson.decode(held)['owner'] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class Scripts:
    """The scripts above, registered with one client (redis-py loads each on first use)."""

    create_job: Script
    transition: Script
    update_progress: Script
    append_ledger: Script
    put_instance: Script
    end_instance: Script
    release_claim: Script
    advance_clock: Script
    acquire_lease: Script
    release_lease: Script

    @classmethod
    def register(cls, client: redis.Redis) -> Scripts:
        return cls(
            create_job=client.register_script(CREATE_JOB_LUA),
            transition=client.register_script(TRANSITION_LUA),
            update_progress=client.register_script(UPDATE_PROGRESS_LUA),
            append_ledger=client.register_script(APPEND_LEDGER_LUA),
            put_instance=client.register_script(PUT_INSTANCE_LUA),
            end_instance=client.register_script(END_INSTANCE_LUA),
            release_claim=client.register_script(RELEASE_CLAIM_LUA),
            advance_clock=client.register_script(ADVANCE_CLOCK_LUA),
            acquire_lease=client.register_script(ACQUIRE_LEASE_LUA),
            release_lease=client.register_script(RELEASE_LEASE_LUA),
        )

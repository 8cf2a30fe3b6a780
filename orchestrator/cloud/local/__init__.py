"""The offline world: the same controller, run against local stand-ins for AWS.

* `clock`: simulated time (`ReplayClock`, N times faster than real time; `FakeClock`).
* `moto_server`: moto's EC2 over HTTP on loopback (`MotoEC2Server`).
* `redis_process`: a throwaway `redis-server` (`LocalRedis`).
* `evictions`: spot reclaims replayed from an availability trace, with the two-minute notice
  (`EvictionReplayer`).
* `metadata_mock`: an instance's IMDSv2 on loopback (`MetadataMock`: tags, notices).
* `fleet`: one instance agent process and one instance metadata mock per running GPU instance
  (`LocalFleet`; the agent itself is `orchestrator.agent`, the same as on AWS), and
  `reports`: what the agents report to it.

The modules are imported one by one (this package re-exports nothing), so an agent process
(which needs only `clock` and `reports`) does not load the rest.

A demo loop (see `tests/integration/offline/test_local_world.py` for a complete one)::

    with LocalRedis() as r, MotoEC2Server() as aws:
        clock = ReplayClock(T0, speed=600)
        store = RedisStore.connect(r.url, namespace=NS)
        controller = build_controller(settings, store=store, client=aws.client())
        replayer = EvictionReplayer(aws.client(), CID, AvailabilityTrace.bundled(), clock,
                                    seed=0, on_notice=controller.notify)
        with LocalFleet(r.url, NS, clock, cloud_client=aws.client(), controller_id=CID,
                        replayer=replayer) as fleet:
            while not done:
                controller.tick(clock.now()); replayer.step(); fleet.step(); time.sleep(0.2)
"""

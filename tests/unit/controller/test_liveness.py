"""Pay only for work: an instance whose node is not in its job's training (never joined, or
left and did not come back) is released with a reason and BidBrain buys one in its place; a
node that is slow to join, an instance under a notice, a restarted controller and a runtime
that does not say are left alone."""

from __future__ import annotations

from support.controller_training import T0, training_world

from orchestrator.controller.liveness import JobLiveness, LivenessWatch
from orchestrator.controller.outcomes import TrainingOutcome
from orchestrator.settings import ControllerSettings, Settings
from orchestrator.store import InstanceRecord, JobState, ReleaseEvent


def _rec(instance_id: str, launched_at: float = T0) -> InstanceRecord:
    return InstanceRecord(
        instance_id=instance_id, job_id="job-1", allocation_id="a", instance_type="p3.2xlarge",
        zone="us-east-1a", lifecycle="spot", launched_at=launched_at, state="running",
    )  # fmt: skip


def _members(*ids: str) -> TrainingOutcome:
    return TrainingOutcome(10, 100, members=frozenset(ids))


def test_a_node_that_never_joins_is_released_after_the_join_grace() -> None:
    watch = LivenessWatch(join_grace_s=900.0, rejoin_grace_s=180.0)
    seen = JobLiveness()
    alive = [_rec("i-a"), _rec("i-b")]
    assert watch.check(seen, _members("i-a"), alive, (), T0) == []
    assert watch.check(seen, _members("i-a"), alive, (), T0 + 900.0) == []  # slow boot
    [silent] = watch.check(seen, _members("i-a"), alive, (), T0 + 901.0)
    assert silent.instance.instance_id == "i-b" and not silent.joined_before
    assert "did not join the job's training in the 901 s since launch" in silent.why


def test_a_node_that_left_is_released_after_the_rejoin_grace_unless_it_comes_back() -> None:
    watch = LivenessWatch(join_grace_s=900.0, rejoin_grace_s=180.0)
    seen = JobLiveness()
    alive = [_rec("i-a"), _rec("i-b")]
    assert watch.check(seen, _members("i-a", "i-b"), alive, (), T0 + 100.0) == []
    assert watch.check(seen, _members("i-a"), alive, (), T0 + 200.0) == []
    assert watch.check(seen, _members("i-a", "i-b"), alive, (), T0 + 270.0) == []  # back
    assert watch.check(seen, _members("i-a"), alive, (), T0 + 300.0) == []  # gone again
    assert watch.check(seen, _members("i-a"), alive, (), T0 + 480.0) == []
    [silent] = watch.check(seen, _members("i-a"), alive, (), T0 + 481.0)
    assert silent.instance.instance_id == "i-b" and silent.joined_before
    assert silent.unheard_s == 181.0 and "left the job's training 181 s ago" in silent.why


def test_a_node_that_joined_and_died_between_two_ticks_counts_as_left() -> None:
    """The runtime heard it (it joined), though no tick saw it a member: the rejoin grace,
    not the join grace, applies."""
    watch = LivenessWatch(join_grace_s=900.0, rejoin_grace_s=180.0)
    seen = JobLiveness()
    alive = [_rec("i-a")]
    assert watch.check(seen, _members(), alive, (), T0) == []
    gone = TrainingOutcome(10, 100, members=frozenset(), heard=frozenset({"i-a"}))
    assert watch.check(seen, gone, alive, (), T0 + 60.0) == []
    [silent] = watch.check(seen, gone, alive, (), T0 + 241.0)
    assert silent.joined_before and silent.unheard_s == 181.0


def test_a_job_whose_replacements_keep_dying_without_training_is_hopeless() -> None:
    """Nodes that join and die (killed loading the data) are replaced a few times, not until
    the budget is gone: three fleets' worth released (its most instances alive at once, two
    here) with no iteration trained in between, whether they die together or one by one."""
    watch = LivenessWatch(join_grace_s=100.0, rejoin_grace_s=10.0)
    seen = JobLiveness()
    now, released = T0, 0
    for k, size in enumerate((2, 1, 1, 2)):  # dying together, then one at a time
        recs = [_rec(f"i-{k}-{n}", launched_at=now) for n in range(size)]
        watch.check(seen, _members(*(r.instance_id for r in recs)), recs, (), now + 1.0)
        released += len(watch.check(seen, _members(), recs, (), now + 2.0))
        assert watch.hopeless(seen) == 0
        released += len(watch.check(seen, _members(), recs, (), now + 13.0))  # and died
        now += 20.0
    assert released == 6 and watch.hopeless(seen) == 6
    progress = TrainingOutcome(11, 100, members=frozenset())  # an iteration trained: hope
    watch.check(seen, progress, [], (), now)
    assert watch.hopeless(seen) == 0


def test_instances_under_a_notice_and_runtimes_that_do_not_say_are_left_alone() -> None:
    watch = LivenessWatch(join_grace_s=60.0, rejoin_grace_s=60.0)
    seen = JobLiveness()
    alive = [_rec("i-a")]
    late = T0 + 10_000.0
    assert watch.check(seen, _members(), alive, (), T0) == []  # the job seen at launch
    assert watch.check(seen, _members(), alive, {"i-a"}, late) == []  # doomed: it goes
    assert watch.check(seen, TrainingOutcome(10, 100), alive, (), late) == []  # None
    not_live = TrainingOutcome(10, 100, live=False, members=frozenset())
    assert watch.check(seen, not_live, alive, (), late) == []
    trained = TrainingOutcome(100, 100, done=True, members=frozenset())
    assert watch.check(seen, trained, alive, (), late) == []
    assert len(watch.check(seen, _members(), alive, (), late)) == 1


def test_a_restarted_controller_gives_every_instance_a_fresh_join_grace() -> None:
    """Instances launched hours ago whose nodes have not reconnected to the runtime hosted
    again are not released at the restarted controller's first look."""
    watch = LivenessWatch(join_grace_s=900.0, rejoin_grace_s=180.0)
    seen = JobLiveness()
    alive = [_rec("i-a"), _rec("i-b")]
    first = T0 + 5 * 3600.0
    assert watch.check(seen, _members(), alive, (), first) == []
    assert watch.check(seen, _members("i-a"), alive, (), first + 900.0) == []
    [silent] = watch.check(seen, _members("i-a"), alive, (), first + 901.0)
    assert silent.instance.instance_id == "i-b"


def test_the_controller_replaces_an_instance_whose_node_left_and_says_why(
    store, ec2, prices
) -> None:
    settings = Settings(controller=ControllerSettings(join_grace_s=600.0, rejoin_grace_s=120.0))
    ctl, training, cloud = training_world(store, ec2, prices, settings)
    alive = store.list_instances("job-1", alive_only=True)
    ids = {r.instance_id for r in alive}
    training.outcome_now = TrainingOutcome(5, 100, members=frozenset(ids))
    ctl.tick(T0 + 300.0)
    dead = sorted(ids)[0]
    training.outcome_now = TrainingOutcome(6, 100, members=frozenset(ids - {dead}))
    ctl.tick(T0 + 360.0)
    assert dead in {i.instance_id for i in cloud.describe()}  # within the grace
    spent_before = ctl.spend_usd("job-1", T0 + 481.0)
    report = ctl.tick(T0 + 481.0)
    assert dead in report.terminated and dead not in {i.instance_id for i in cloud.describe()}
    assert report.launched, "BidBrain buys a working instance in its place"
    [release] = [
        e for _, e in store.events("job-1") if isinstance(e, ReleaseEvent) and e.instance_id == dead
    ]
    assert release.reason == "released" and "left the job's training 121 s ago" in release.detail
    # its bill is in the ledger now, and counted once in what the job has spent
    assert abs(ctl.spend_usd("job-1", T0 + 481.0) - spent_before) < 1e-6
    decision = [e for _, e in store.events("job-1") if e.kind == "decision"][-1]
    assert abs(decision.spent_usd - spent_before) < 1e-6
    assert store.get_instance(dead).end_reason == "released"


def test_a_job_whose_nodes_keep_dying_fails_instead_of_buying_forever(store, ec2, prices) -> None:
    """Every instance's node joins and then dies (as a node killed loading a too-large data
    set): replaced a few times, then the job fails saying so; never a loop to the budget."""
    settings = Settings(controller=ControllerSettings(join_grace_s=600.0, rejoin_grace_s=120.0))
    ctl, training, cloud = training_world(store, ec2, prices, settings)
    now = T0
    for _ in range(40):
        alive = {r.instance_id for r in store.list_instances("job-1", alive_only=True)}
        training.outcome_now = TrainingOutcome(
            0, 100, nodes_heard=len(alive), members=frozenset(alive)
        )
        now += 60.0
        ctl.tick(now)  # they join...
        training.outcome_now = TrainingOutcome(0, 100, nodes_heard=len(alive), members=frozenset())
        now += 60.0
        ctl.tick(now)  # ...and die
        now += 121.0
        ctl.tick(now)
        if store.get_job("job-1").state.is_terminal:
            break
    job = store.get_job("job-1")
    assert job.state is JobState.FAILED, job
    assert (
        job.message.startswith("no progress: ")
        and "released because their nodes left" in job.message
    )
    assert cloud.describe() == []
    # released twice with the reason (the round's instances: the reliable node and one-GPU
    # spot ones), and the third time the job fails (and they go with it)
    released = [e for _, e in store.events("job-1") if isinstance(e, ReleaseEvent)]
    per_round = len(released) // 3
    assert per_round >= 2 and len(released) == 3 * per_round
    assert sum(1 for e in released if e.detail) == 2 * per_round

"""Fair sharing between clients (scheduler_proc.fair_share): a client flooding the engine
cannot keep another client's request waiting behind its backlog or its running streams."""

from __future__ import annotations

from fake_worker import Collector, FakeWorker, drive, make_request, reference_generate

from scheduler_proc import Scheduler, SchedulerConfig

HOG, VICTIM = "1", "2"


class FinishOrder(Collector):
    """A Collector that also notes the order in which requests finish."""

    def __init__(self) -> None:
        super().__init__()
        self.finished: list[int] = []

    def add(self, deltas) -> None:
        super().add(deltas)
        if deltas is not None:
            self.finished += [rid for rid, reason in zip(deltas.request_ids,
                                                          deltas.finish_reasons, strict=True)
                              if reason is not None]


def flooded(num_blocks=512, max_seqs=4, hog_requests=300, **kw):
    """A scheduler whose slots all run the hog's long requests, hundreds more waiting."""
    kw.setdefault("max_model_len", 256)
    sched = Scheduler(SchedulerConfig(num_blocks, 4, max_num_seqs=max_seqs, **kw))
    worker = FakeWorker(num_blocks, 4)
    for rid in range(hog_requests):
        sched.add_request(make_request(rid, 8, max_tokens=100, ignore_eos=True, client=HOG))
    return sched, worker


def step(sched, worker, collector):
    plan = sched.schedule()
    if plan is not None:
        collector.add(sched.process_result(worker.execute(plan)))
    collector.add(sched.pop_deltas())
    sched.check_integrity()
    return plan


def test_a_second_client_takes_a_slot_at_once_from_a_client_holding_them_all():
    sched, worker = flooded()
    c = FinishOrder()
    for _ in range(3):
        step(sched, worker, c)
    assert len(sched.running) == 4 and len(sched.waiting) == 296
    victim = make_request(1000, 8, max_tokens=5, ignore_eos=True, client=VICTIM)
    sched.add_request(victim)
    plan = step(sched, worker, c)
    assert [ns.seq_id for ns in plan.new_seqs] == [1000]
    assert len(plan.drop_seq_ids) == 1  # the hog's newest gave its slot up
    drive(sched, worker, c)
    # The victim's 5 tokens came long before the hog's backlog drained.
    assert c.finished.index(1000) < 10
    assert c.outputs[1000].token_ids == reference_generate(
        victim.prompt_token_ids, victim.params, [], 256)[0]
    for rid in range(300):  # and the hog lost nothing by it
        assert len(c.outputs[rid].token_ids) == 100


def test_a_free_slot_goes_to_the_client_holding_the_fewest():
    # Slots to spare, but the token budget admits two 8-token prompts a step: the hog came
    # first with hundreds, yet the victim is admitted in the very first step.
    sched, worker = flooded(max_seqs=64, max_num_batched_tokens=16)
    sched.add_request(make_request(1000, 8, max_tokens=5, client=VICTIM))
    plan = step(sched, worker, FinishOrder())
    assert [ns.seq_id for ns in plan.new_seqs] == [0, 1000]


def test_clients_are_served_in_turn():
    # Three clients, each with a backlog: admissions go round, one request each.
    sched = Scheduler(SchedulerConfig(512, 4, max_num_seqs=64, max_num_batched_tokens=8,
                                      max_model_len=256))
    worker = FakeWorker(512, 4)
    for client, first in (("a", 0), ("b", 100), ("c", 200)):
        for k in range(20):
            sched.add_request(make_request(first + k, 8, max_tokens=50, client=client))
    admitted = []
    while len(admitted) < 9:
        admitted += [ns.seq_id for ns in step(sched, worker, Collector()).new_seqs]
    assert admitted[:9] == [0, 100, 200, 1, 101, 201, 2, 102, 202]


def test_pool_pressure_preempts_the_largest_client_not_the_newcomer():
    # The pool holds far less than the four streams need: someone must be preempted, again
    # and again; never the victim, admitted last but the smallest client.
    sched = Scheduler(SchedulerConfig(20, 4, max_num_seqs=8, max_model_len=64))
    worker = FakeWorker(20, 4)
    for rid in range(3):
        sched.add_request(make_request(rid, 8, max_tokens=40, ignore_eos=True, client=HOG))
    sched.add_request(make_request(9, 8, max_tokens=40, ignore_eos=True, client=VICTIM))

    def victim_never_preempted(s, _step):
        if 9 in s.seqs:
            assert s.seqs[9].num_preemptions == 0

    c = drive(sched, worker, FinishOrder(), hook=victim_never_preempted)
    assert sched.stats().preemptions > 0
    assert all(len(c.outputs[rid].token_ids) == 40 for rid in (0, 1, 2, 9))


def test_one_client_keeps_first_come_first_served():
    sched, worker = flooded(max_seqs=2, hog_requests=6)
    c = FinishOrder()
    drive(sched, worker, c)
    assert c.finished == [0, 1, 2, 3, 4, 5] and sched.stats().preemptions == 0


def test_two_flooding_clients_settle_at_equal_shares_without_thrashing():
    # The hog holds all four slots when the second client floods too: two preemptions even
    # the shares, and from then on each client holds two slots until its backlog runs out.
    sched, worker = flooded(max_seqs=4, hog_requests=40)
    c = FinishOrder()
    for _ in range(3):
        step(sched, worker, c)
    for rid in range(1000, 1040):
        sched.add_request(make_request(rid, 8, max_tokens=100, ignore_eos=True, client=VICTIM))
    shares = []

    def note_shares(s, _step):
        clients = s.waiting.clients
        if HOG in clients and VICTIM in clients and clients[HOG].waiting \
                and clients[VICTIM].waiting:
            shares.append((clients[HOG].running, clients[VICTIM].running))

    drive(sched, worker, c, hook=note_shares)
    assert sched.stats().preemptions == 2
    assert shares[0] == (3, 1) and set(shares[1:]) == {(2, 2)}, shares[:5]

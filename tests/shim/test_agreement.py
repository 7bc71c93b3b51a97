"""``shim.agreement``: ranks stop at one step through a real store, with no collective.

Ranks are threads here, each with its own connection to a real ``TCPStore``,
stepping as DDP ranks do: a rank finishes step ``s`` only once every rank
began it (the gradient all-reduce), so ranks drift by up to a step, and a
rank that waits at a step end holds the others back. Whoever asks, whenever,
every rank must end at the same step, no later than one step after the
asking rank's.
"""

from __future__ import annotations

import datetime
import random
import threading
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

from shim import agreement, jobstore
from shim.agreement import GO, LEAVE, STOP, Decision, StopAgreement


@pytest.fixture
def server() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
    )
    yield store


def connect(server: dist.TCPStore, space: str) -> dist.PrefixStore:
    client = dist.TCPStore(
        "127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30)
    )
    return dist.PrefixStore(space, client)


class Job:
    """``world`` ranks in lockstep within a step; ``wants(rank, step)`` says what each asks."""

    def __init__(self, server: dist.TCPStore, world: int, steps: int, seed: int) -> None:
        self.world, self.steps = world, steps
        self.began = [0] * world
        self.cond = threading.Condition()
        self.ended: dict[int, tuple[int, Decision | None]] = {}
        self.rng = random.Random(seed)
        self.delays = [[self.rng.random() * 0.004 for _ in range(steps + 1)] for _ in range(world)]
        space = f"job-{seed}"
        self.agreements = [
            StopAgreement(1, jobstore.Space(connect(server, space), rank, world))
            for rank in range(world)
        ]

    def run(self, wants: Callable[[int, int], int]) -> dict[int, tuple[int, Decision | None]]:
        threads = [threading.Thread(target=self._rank, args=(r, wants)) for r in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        return self.ended

    def _rank(self, rank: int, wants: Callable[[int, int], int]) -> None:
        decision = None
        step = 0
        for step in range(1, self.steps + 1):
            threading.Event().wait(self.delays[rank][step])  # forward, backward
            with self.cond:
                self.began[rank] = step
                self.cond.notify_all()
                self.cond.wait_for(lambda s=step: min(self.began) >= s)  # the all-reduce
            decision = self.agreements[rank].at_step_end(step, wants(rank, step))
            if decision is not None:
                break
        else:
            self.agreements[rank].close()
            with self.cond:
                self.began[rank] = self.steps + 1  # gone: holds nobody back
                self.cond.notify_all()
        with self.cond:
            self.ended[rank] = (step, decision)
            self.cond.notify_all()


@pytest.mark.parametrize("seed", range(6))
def test_one_rank_asks_and_every_rank_stops_at_one_step(server: dist.TCPStore, seed: int) -> None:
    job = Job(server, world=8, steps=60, seed=seed)
    asker, at = job.rng.randrange(8), job.rng.randrange(5, 40)
    ended = job.run(lambda rank, step: STOP if rank == asker and step >= at else GO)
    steps = {step for step, _ in ended.values()}
    assert len(steps) == 1, ended
    [step] = steps
    assert at <= step <= at + 1  # the asking rank's step, or the next when another had passed it
    assert all(decision == Decision(step, STOP) for _, decision in ended.values())


def test_a_rank_that_leaves_wins_over_one_that_stops(server: dist.TCPStore) -> None:
    job = Job(server, world=4, steps=30, seed=11)
    ended = job.run(
        lambda rank, step: (
            STOP if rank == 1 and step >= 9 else LEAVE if rank == 2 and step >= 9 else GO
        )
    )
    assert {decision for _, decision in ended.values()} in (
        {Decision(9, LEAVE)},
        {Decision(10, LEAVE)},
    )


def test_a_rank_that_must_leave_after_its_post_takes_every_rank_with_it(
    server: dist.TCPStore,
) -> None:
    """Rank 1's thread posted "go on" for rank 0's request; by the agreed step rank 1
    can no longer follow its loop: no rank saves that step, every rank leaves."""
    ranks = [StopAgreement(1, jobstore.Space(connect(server, "late"), r, 2)) for r in range(2)]
    for rank in ranks:
        assert rank.at_step_end(4, GO) is None
    ended: dict[int, Decision | None] = {}
    asking = threading.Thread(target=lambda: ended.update({0: ranks[0].at_step_end(5, STOP)}))
    asking.start()
    assert ranks[1]._decided.wait(10)  # its thread posted and read the decision: stop at 5
    assert ranks[1].decision == Decision(5, STOP)
    ended[1] = ranks[1].at_step_end(5, LEAVE)
    asking.join(10)
    assert ended == {0: Decision(5, LEAVE), 1: Decision(5, LEAVE)}


def test_a_request_after_the_other_ranks_ended_does_not_hang(server: dist.TCPStore) -> None:
    """A SIGTERM at the last step of rank 0, after rank 1's run ended: rank 0 goes on."""
    job = Job(server, world=2, steps=5, seed=3)

    def wants(rank: int, step: int) -> int:
        if rank == 0 and step == 5:
            with job.cond:  # the signal comes once rank 1 is through its last step end
                assert job.cond.wait_for(lambda: 1 in job.ended, timeout=30)
            return STOP
        return GO

    ended = job.run(wants)
    assert ended[1] == (5, None)
    assert ended[0] == (5, None)  # decided for step 6: the run ended before it


def test_many_ranks_need_a_request_each_and_one_read_of_all_posts(server: dist.TCPStore) -> None:
    job = Job(server, world=32, steps=8, seed=5)
    ended = job.run(lambda rank, step: STOP if rank == 17 and step >= 4 else GO)
    assert len({step for step, _ in ended.values()}) == 1
    keys = server.num_keys()
    # per rank: its go key and its post; for the job: the counter and the decision, and
    # at the stop step the count of ranks settling and the mark that all did
    assert keys <= 2 * 32 + 4 + 1  # (+1: the server's own key of its workers)


def test_a_world_of_one_decides_at_once() -> None:
    alone = StopAgreement(1)
    assert alone.at_step_end(1, GO) is None
    assert alone.at_step_end(2, STOP) == Decision(2, STOP)


def test_a_store_that_never_answers_leaves_without_a_checkpoint(
    server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(agreement, "DECISION_TIMEOUT_SECONDS", 0.5)
    lonely = StopAgreement(1, jobstore.Space(connect(server, "lonely"), 0, 2))  # rank 1 never comes
    assert lonely.at_step_end(3, STOP) == Decision(3, LEAVE)
    assert "did not agree on a stop step within 0.5 s" in capsys.readouterr().err
    lonely.close()

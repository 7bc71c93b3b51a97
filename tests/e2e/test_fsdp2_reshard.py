"""A plain FSDP2 loop preempted and re-created with another number of nodes resumes resharded.

The torchtitan-shaped script (``scripts/loop_fsdp2.py``, 96 samples, batches
of 4 per rank, ``DistributedSampler(shuffle=True, seed=7)``) prints every
batch's sample numbers. What must hold, since bitwise equality cannot (the
global batch changes size with the number of ranks):

- the job resumes from the JIT checkpoint (not from the start) and finishes;
- the data position: the old ranks took the first ``P`` positions of epoch
  0's order (its permutation, dealt out in turn); each new rank goes on with
  exactly its share of the positions after ``P``, as the shim's log says, with
  none seen twice and none before ``P`` skipped; where the new world's pass
  ends is the one it states;
- the loss curve: the held-out loss after each epoch within 2% of the
  uninterrupted run's (the model and optimizer state put back is the saved one;
  from there the runs differ by their batch sizes only).
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

from tests.e2e.support import demo_summary

SCRIPT = Path(__file__).with_name("scripts") / "loop_fsdp2.py"
DATASET, BATCH, SEED, STEP = 96, 4, 7, 7
SAMPLES = re.compile(r"^rank (\d+) epoch (\d+) samples (\[[\d, ]*\])$")
HELD_OUT = re.compile(r"^epoch (\d+) held-out loss ([\d.]+)$", re.MULTILINE)
ENDS = re.compile(r"the pass ends at position (\d+) \(the uninterrupted run's at (\d+)")


def batches(logs: list[str], epoch: int) -> dict[int, list[list[int]]]:
    """Each rank's batches of ``epoch``, in order, from the trainers' logs."""
    found: dict[int, list[list[int]]] = {}
    for log in logs:
        for line in Path(log).read_text(errors="replace").splitlines():
            match = SAMPLES.match(line)
            if match and int(match[2]) == epoch:
                found.setdefault(int(match[1]), []).append(ast.literal_eval(match[3]))
    return found


def flat(lists: object) -> list[int]:
    return list(itertools.chain.from_iterable(lists))  # type: ignore[call-overload]


def held_out(logs: list[str]) -> dict[int, float]:
    text = "\n".join(Path(log).read_text(errors="replace") for log in logs)
    return {int(m[1]): float(m[2]) for m in HELD_OUT.finditer(text)} or {-1: -1.0}


def order(epoch: int) -> list[int]:
    """DistributedSampler's global order of ``epoch`` before it is dealt out (no padding:
    96 divides by 1 and 2)."""
    import torch

    generator = torch.Generator().manual_seed(SEED + epoch)
    return torch.randperm(DATASET, generator=generator).tolist()


def expected_end(new: int, skipped: int) -> int:
    """Where the resumed pass ends: each new rank's samples after the skip, in whole batches."""
    left = (DATASET // new - skipped) // BATCH * BATCH
    return (skipped + left) * new


@pytest.mark.slow
@pytest.mark.parametrize(("old", "new"), [(2, 1), (1, 2)])
def test_fsdp2_loop_resumes_on_another_node_count(tmp_path: Path, old: int, new: int) -> None:
    options = ["--nnodes", str(old), "--resume-nnodes", str(new), "--preempt-nodes", "one"]
    options += ["--preempt-at-step", str(STEP), "--keep", "--", "--log-samples"]
    summary = demo_summary(SCRIPT, options, tmp_path / "demo", timeout=600)
    assert summary["ok"] is True, summary
    assert summary["jit_checkpoint_step"] == summary["resumed_from_step"] == STEP
    logs = summary["trainer_logs"]
    assert len(logs["preempted"]) == old and len(logs["resumed"]) == new

    # The old ranks took the first P positions of epoch 0's order, STEP batches each.
    first = order(0)
    taken = STEP * BATCH * old
    before = batches(logs["preempted"], 0)
    assert sorted(before) == list(range(old))
    for rank, seen in before.items():
        assert flat(seen) == first[rank:taken:old]

    # Each new rank goes on from position P with its share, to the end the log states.
    skipped = taken // new
    end = expected_end(new, skipped)
    text = "\n".join(Path(log).read_text(errors="replace") for log in logs["resumed"])
    assert f"from position {skipped * new} of its order" in text
    assert "0 position(s) are seen a second time" in text
    ends = ENDS.search(text)
    assert ends is not None and int(ends[1]) == end, text[-3000:]
    after = batches(logs["resumed"], 0)
    assert sorted(after) == list(range(new))
    for rank, seen in after.items():
        assert flat(seen) == first[taken + rank : end : new]
    everything = [sample for seen in [*before.values(), *after.values()] for sample in flat(seen)]
    assert sorted(everything) == sorted(first[:end])  # none twice, none skipped before the end

    # Epoch 1 is the new world's own: all of it, once.
    last = [sample for seen in batches(logs["resumed"], 1).values() for sample in flat(seen)]
    assert sorted(last) == list(range(DATASET))

    resumed, uninterrupted = held_out(logs["resumed"]), held_out(logs["uninterrupted"])
    assert sorted(resumed) == sorted(uninterrupted) == [0, 1], (resumed, uninterrupted)
    for epoch, loss in uninterrupted.items():
        assert abs(resumed[epoch] - loss) <= 0.02 * loss, (resumed, uninterrupted)

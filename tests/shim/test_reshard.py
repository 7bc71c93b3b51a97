"""``reshard``: a DistributedSampler's place mapped onto another number of ranks, and the
checkpoints that are not mapped (said, not used).

The mapping is checked against torch's own DistributedSampler: the samples
the old ranks took, then those the new ranks take after skipping what the
shim says they skip, are the epoch's order without a sample twice (but the
stated repeats) and without a gap, up to the end the shim states.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from shim.dataloaders import distributed_sampler
from shim.frameworks.plain.layout import reshard


def loader(size: int, world: int, rank: int, batch: int, **options: Any) -> DataLoader:
    sampler = DistributedSampler(
        TensorDataset(torch.arange(size)), num_replicas=world, rank=rank, seed=3, **options
    )
    sampler.set_epoch(2)
    return DataLoader(sampler.dataset, batch_size=batch, sampler=sampler, drop_last=True)


def entry(source: DataLoader, yielded: int) -> dict[str, Any]:
    """A rank file's record of a pass under way (as ``Tracker.snapshot`` writes it)."""
    return {
        "index": 0,
        "iteration": 2,
        "yielded": yielded,
        "exhausted": False,
        "trigger": True,
        "start": {"generators": []},
        "training": [[0, 2]],
        "epochs": {2: [2]},
        "signature": {"class": "DataLoader", "length": len(source), "batch_size": 4},
        "lookahead": None,
        "offset": 0,
        "sampler": distributed_sampler(source),
    }


def saved(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"sharded": "dcp", "loaders": entries}


def samples(source: DataLoader, skip: int = 0) -> list[int]:
    """What a rank's loader yields after its sampler skipped ``skip`` indices."""
    indices = list(iter(source.sampler))[skip:]
    batch = source.batch_size
    assert batch is not None
    return indices[: len(indices) // batch * batch]


@pytest.mark.parametrize(
    ("size", "old", "new", "yielded", "padded"),
    [(96, 2, 1, 7, False), (96, 1, 2, 7, False), (50, 3, 2, 3, False), (50, 2, 3, 4, True)],
)
def test_the_new_ranks_go_on_where_the_old_ranks_stopped(
    size: int, old: int, new: int, yielded: int, padded: bool
) -> None:
    taken: list[int] = []
    for rank in range(old):
        taken += samples(loader(size, old, rank, 4, drop_last=not padded))[: yielded * 4]
    record = saved([entry(loader(size, old, 0, 4, drop_last=not padded), yielded)])
    problem, notes = reshard.adapt(record, old, new, 0)
    assert problem is None
    mapped = record["loaders"][0]
    skip = mapped["offset"]
    said = re.search(
        r"(\d+) position\(s\) are seen a second time; the pass ends at position (\d+)", notes[0]
    )
    assert said is not None
    again, end = int(said[1]), int(said[2])
    rest: list[int] = []
    for rank in range(new):
        target = loader(size, new, rank, 4, drop_last=not padded)
        assert mapped["sampler"] == dict(distributed_sampler(target) or {}, rank=0)
        rest += samples(target, skip)
    generator = torch.Generator().manual_seed(3 + 2)
    order = torch.randperm(size, generator=generator).tolist()
    order = (order * 2)[: max(end, len(taken))]
    assert sorted(taken + rest) == sorted(order[: len(taken)] + order[len(taken) - again : end])
    assert len(taken) + len(rest) == end + again


def test_only_dcp_checkpoints_and_distributed_samplers_are_mapped() -> None:
    ddp = {"sharded": None, "loaders": []}
    assert "FSDP2" in (reshard.adapt(ddp, 2, 1, 0)[0] or "")
    other = entry(loader(96, 2, 0, 4), 3)
    other["sampler"] = None  # a RandomSampler, a sampler of the program's
    assert "not torch's DistributedSampler" in (reshard.adapt(saved([other]), 2, 1, 0)[0] or "")
    ahead = entry(loader(96, 2, 0, 4), 3)
    ahead["lookahead"] = {"generators": []}
    assert "reads ahead" in (reshard.adapt(saved([ahead]), 2, 1, 0)[0] or "")
    finished = dict(entry(loader(96, 2, 0, 4), 12), start=None, exhausted=True, trigger=False)
    assert reshard.adapt(saved([finished]), 2, 1, 0)[0] is None  # a finished pass yields nothing

"""A pass replayed by the DataLoader tracker hands out what the uninterrupted pass did.

Real DataLoaders in a real process: a dataset drawing from numpy, Python's
``random`` and torch in ``__getitem__``, a ``collate_fn`` drawing from torch,
worker processes seeded by a ``worker_init_fn``. The place is recorded
mid-pass (``Tracker.record``) and the next pass is armed with it
(``Tracker.arm``): with workers the skipped batches are read again through
them, without workers their indices are skipped. Every batch after the
resume point must equal the uninterrupted pass's.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.shim.support import PYTHON, REPO

# A dataset of 40 items drawing from numpy, Python's random and torch as they are read, and
# a worker_init_fn seeding numpy and random (the persistent workers' tests read it too).
JITTER = """
import json, random, sys
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from shim import dataloaders

dataloaders.install(torch)
dataloaders.TRACKER.follow_only()


class Jitter(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, index):
        noise = np.random.normal(size=3) + random.random() + torch.rand(3).numpy()
        return torch.tensor(noise + index, dtype=torch.float64)


def seed_worker(worker_id):
    np.random.seed(torch.initial_seed() % 2**32)
    random.seed(torch.initial_seed())
"""

REPLAY = (
    JITTER
    + """

def scaled(items):
    return torch.stack(items) * torch.rand(1, dtype=torch.float64)


workers = int(sys.argv[1])
torch.manual_seed(0)
loader = DataLoader(Jitter(), batch_size=4, shuffle=True, num_workers=workers,
                    worker_init_fn=seed_worker if workers else None, collate_fn=scaled)
first, record, after = [], None, None
for number, batch in enumerate(loader):
    first.append(batch)
    if number == 3:
        record = dataloaders.TRACKER.record(loader)
        after = dataloaders.rngstate.capture()
assert dataloaders.TRACKER.arm(loader, record, lambda: dataloaders.rngstate.restore(after))
torch.manual_seed(99)  # whatever the states are now: the replay puts back its own
replayed = list(loader)
print(json.dumps({
    "count": len(replayed),
    "equal": [torch.equal(a, b) for a, b in zip(replayed, first[4:])],
}))
"""
)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_replayed_pass_continues_with_the_same_random_batches(workers: int) -> None:
    done = subprocess.run(
        [PYTHON, "-c", REPLAY, str(workers)],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["count"] == 6
    assert result["equal"] == [True] * 6

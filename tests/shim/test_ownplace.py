"""Loaders that keep their own place, optimizers that wrap others, and the words for both.

Real processes with the shim active (no sidecar): torchdata's ``StatefulDataLoader``
and HF ``datasets``' streams are followed through their own ``state_dict()``, what
cannot be is named by its real reason, and an optimizer holding others is counted once.
"""

from __future__ import annotations

import json
import subprocess

from tests.shim.support import PYTHON, REPO, ShimEnv


def run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-c", code],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )


HOLDERS = """
import json, sys
import datasets
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from _jitckpt_shim import dataloaders

def stream():
    rows = datasets.Dataset.from_dict({"x": list(range(32))})
    return rows.to_iterable_dataset(num_shards=2)

StatefulDataLoader(stream(), batch_size=4, num_workers=1)
StatefulDataLoader(stream().shuffle(seed=1, buffer_size=8), batch_size=4)
DataLoader(stream(), batch_size=4)
DataLoader(stream(), batch_size=4, num_workers=2)
tracks = dataloaders.TRACKER.tracks
print(json.dumps([[tracks[i].own, tracks[i].problem] for i in sorted(tracks)]))
"""


def test_loaders_that_keep_their_own_place_are_followed_or_named(shim_env: ShimEnv) -> None:
    """``datasets`` is imported before torch, as scripts do: the shim follows torch all the same."""
    done = run(HOLDERS, shim_env.env)
    loader, shuffled, dataset, in_workers = json.loads(done.stdout.splitlines()[-1])
    assert loader == ["loader", None]  # its worker's place is in its own snapshot
    assert shuffled[0] == "loader" and "shuffle buffer" in shuffled[1]
    assert dataset == ["dataset", None]  # read in this process: the dataset holds the place
    assert in_workers[0] == "dataset" and "2 worker processes" in in_workers[1]


UNSEEN = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Prefetching(DataLoader):
    def __iter__(self):
        yield from super().__iter__()


torch.manual_seed(0)
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for (x,) in Prefetching(TensorDataset(torch.randn(16, 4)), batch_size=4):
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()
print("trained", flush=True)
"""


def test_a_loop_whose_batches_the_shim_cannot_see_is_named_by_its_loader(
    shim_env: ShimEnv,
) -> None:
    done = run(UNSEEN, shim_env.env)
    assert "trained" in done.stdout
    said = [line for line in done.stderr.splitlines() if "cannot be resumed exactly" in line]
    assert len(said) == 1
    assert "DataLoader #0: Prefetching has its own __iter__" in said[0]
    assert "itertools.cycle" not in said[0]


WRAPPED = """
import json
import torch
from torch import nn
from _jitckpt_shim.frameworks.plain.layout import state


class Container(torch.optim.Optimizer):
    '''One optimizer over others, stepping them (torchtitan's OptimizersContainer).'''

    def __init__(self, parts):
        self.optimizers = [torch.optim.AdamW(p.parameters(), lr=0.01) for p in parts]
        params = [p for part in parts for p in part.parameters()]
        torch.optim.Optimizer.__init__(self, params, {})

    def step(self, closure=None):
        for optimizer in self.optimizers:
            optimizer.step()


parts = [nn.Linear(2, 2), nn.Linear(2, 2)]
container = Container(parts)
alone = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
found = state.Objects().optimizers
print(json.dumps([type(o).__name__ for o in found]))
"""


def test_an_optimizer_that_wraps_others_is_counted_once(shim_env: ShimEnv) -> None:
    done = run(WRAPPED, shim_env.env)
    assert json.loads(done.stdout.splitlines()[-1]) == ["AdamW", "AdamW", "SGD"]


FABRICS = """
import json
import lightning as L
from lightning.fabric.strategies import ModelParallelStrategy
from _jitckpt_shim.frameworks.fabric import strategies

print(json.dumps([strategies.problem(), strategies.described()]))
fsdp2 = ModelParallelStrategy(parallelize_fn=lambda model, mesh: model)
fabric = L.Fabric(accelerator="cpu", strategy=fsdp2, devices=1)
print(json.dumps([strategies.problem(), strategies.described()]))
"""


def test_fabric_strategies_that_keep_their_own_state_are_named(shim_env: ShimEnv) -> None:
    done = run(FABRICS, shim_env.env)
    without, fsdp2 = (json.loads(line) for line in done.stdout.splitlines()[-2:])
    assert without == [None, ""]
    assert "Fabric's ModelParallelStrategy keeps the training state its own way" in fsdp2[0]
    assert fsdp2[1] == " (Lightning Fabric: ModelParallelStrategy, Precision)"

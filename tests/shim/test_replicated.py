"""A DDP loop's replicated state in its checkpoint once, spread over the ranks, and checked.

Kubeflow's MNIST-shaped DDP loop on 2 processes under the shim, without a
sidecar: the JIT checkpoint stays in the local dir, where the next process
finds it. Its model and optimizer are in the shares, once (one share: the
model is small); each rank file holds that rank's own state only. How the
tensors of a large state are spread over the ranks is ``owners``'s test.
The resume is bitwise; a share missing, or a share whose tensors are not
the ones saved, is said and the checkpoint not used (training starts over).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from shim.frameworks.plain.layout import replicated
from shim.frameworks.plain.layout.replicated import owners
from tests.shim.support import TORCHRUN, ShimEnv, Spawn, checkpoint_steps

SCRIPT = Path(__file__).resolve().parents[1] / "e2e" / "scripts" / "loop_ddp_mnist.py"
HOLD = "JITCKPT_DEMO_HOLD_AT_STEP"
STEP = 5


def ddp(output: Path) -> list[str]:
    command = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(SCRIPT), "--epochs", "1"]
    return [*command, "--save-model", str(output)]


def state_bytes(saved: dict) -> int:
    """The bytes of the tensors of a rank's training modules and optimizers."""
    total = 0

    def walk(value: object) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk([saved["modules"], saved["optimizers"]])
    return total


@pytest.mark.slow
def test_replicated_state_is_saved_once_spread_over_the_ranks_and_checked(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    reference = spawn(ddp(tmp_path / "reference.pt"), shim_env.ranks_without_shim())
    cut = spawn(ddp(tmp_path / "cut.pt"), {**shim_env.env, HOLD: str(STEP)})
    cut.wait_for(f"holding at step {STEP} ", timeout=240)
    cut.signal(signal.SIGTERM)
    assert cut.wait(timeout=120) == 143, cut.output()[-3000:]
    assert reference.wait(timeout=240) == 0, reference.output()[-3000:]
    assert checkpoint_steps(shim_env.checkpoints) == [STEP]
    checkpoint = shim_env.checkpoints / f"checkpoint-{STEP}"
    state = checkpoint / "loop-state"
    # A small model makes one share, written by rank 0 (at least 64 MiB a share).
    shares = [state / "replicated-00000.pt"]
    ranks = [state / f"rank-{rank:05d}.pt" for rank in (0, 1)]
    assert all(path.is_file() for path in shares + ranks)
    assert not (state / "replicated-00001.pt").exists()

    # One copy in all: the shares hold what one rank's training state is, each rank file
    # only the structure, its random states and its data position.
    for path in ranks:
        assert state_bytes(torch.load(path, weights_only=True)) == 0  # none of it
    saved = torch.load(ranks[1], weights_only=True)
    assert replicated.gather(str(checkpoint), saved) is None
    copy = state_bytes(saved)
    share_bytes = sum(path.stat().st_size for path in shares)
    assert copy <= share_bytes <= 1.25 * copy + 4096, (copy, share_bytes)

    # Resumed: bitwise equal to the uninterrupted run.
    resumed = spawn(ddp(tmp_path / "resumed.pt"), shim_env.env)
    assert resumed.wait(timeout=240) == 0, resumed.output()[-3000:]
    assert resumed.output().count(f"resumed at step {STEP}:") == 2
    left = torch.load(tmp_path / "resumed.pt", weights_only=True)
    right = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert [name for name in right if not torch.equal(left[name], right[name])] == []


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "altered"])
def test_a_share_missing_or_not_the_one_saved_is_said_and_not_resumed(
    damage: str, shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    cut = spawn(ddp(tmp_path / "cut.pt"), {**shim_env.env, HOLD: str(STEP)})
    cut.wait_for(f"holding at step {STEP} ", timeout=240)
    cut.signal(signal.SIGTERM)
    assert cut.wait(timeout=120) == 143, cut.output()[-3000:]
    share = shim_env.checkpoints / f"checkpoint-{STEP}" / "loop-state" / "replicated-00000.pt"
    if damage == "missing":
        share.unlink()
        said = "rank 0's share is missing"
    else:
        content = torch.load(share, weights_only=True)
        first = next(iter(content["tensors"]))
        content["tensors"][first] = content["tensors"][first] + 1
        torch.save(content, share)
        said = "its replicated state is not the one saved"
    again = spawn(ddp(tmp_path / "again.pt"), shim_env.env)
    assert again.wait(timeout=240) == 0, again.output()[-3000:]
    output = again.output()
    assert output.count(said) == 2, output[-3000:]  # each rank says why
    assert "training starts over" in output and "resumed at step" not in output


class Sized:
    """What ``owners`` reads of a tensor: its size."""

    def __init__(self, megabytes: int) -> None:
        self.megabytes = megabytes

    def numel(self) -> int:
        return self.megabytes << 20

    def element_size(self) -> int:
        return 1


def test_a_large_state_is_spread_over_ranks_of_every_node_in_shares_that_do_not_grow_with_it() -> (
    None
):
    # 4 x 100 MiB + 8 x 25 MiB = 600 MiB: 10 shares of at least 64 MiB, on 10 of 64 ranks.
    tensors = [Sized(100)] * 4 + [Sized(25)] * 8
    who = owners(tensors, world=64)
    writers = sorted(set(who))
    assert len(writers) == 10
    assert len({rank // 8 for rank in writers}) == 8  # 8 ranks a node: every node writes
    load = {
        rank: sum(t.megabytes for t, r in zip(tensors, who, strict=True) if r == rank)
        for rank in writers
    }
    assert max(load.values()) <= 100 and min(load.values()) >= 25
    # The same state on 1,024 ranks: the same 10 shares, not more.
    assert len(set(owners(tensors, world=1024))) == 10
    # A small state is one share; a job of one rank writes it all.
    assert set(owners([Sized(1)] * 3, world=16)) == {0}
    assert set(owners(tensors, world=1)) == {0}


# Two ranks that train models of their own (no DDP: an ensemble, each on its own data):
# their states differ, so neither may stand for the other's.
NOT_REPLICAS = """
import sys
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
features = torch.randn(64, 8)
labels = (features.sum(dim=1) > 0).long()
loader = DataLoader(TensorDataset(features, labels), batch_size=8, shuffle=True)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(2):
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
torch.save(model.state_dict(), "%s-%d.pt" % (sys.argv[1], rank))
dist.destroy_process_group()
"""


def ensemble(output: Path) -> list[str]:
    script = output.parent / "ensemble.py"
    script.write_text(NOT_REPLICAS)
    return [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script), str(output)]


@pytest.mark.slow
def test_ranks_whose_state_differs_are_said_and_each_resumes_its_own(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """Not data-parallel replicas: the digests differ at the checkpoint, which says so once;
    no share is written, each rank file keeps its own state, and each rank resumes its own
    (bitwise), never the other's."""
    reference = spawn(ensemble(tmp_path / "reference"), shim_env.ranks_without_shim())
    cut = spawn(ensemble(tmp_path / "cut"), {**shim_env.env, HOLD: str(STEP)})
    cut.wait_for(f"holding at step {STEP} ", timeout=240)
    cut.signal(signal.SIGTERM)
    assert cut.wait(timeout=120) == 143, cut.output()[-3000:]
    assert reference.wait(timeout=240) == 0, reference.output()[-3000:]
    said = "are not the same (not data-parallel replicas): each rank's checkpoint file holds"
    assert cut.output().count(said) == 2, cut.output()[-3000:]  # once a rank
    state = shim_env.checkpoints / f"checkpoint-{STEP}" / "loop-state"
    assert not list(state.glob("replicated-*.pt"))
    ranks = [torch.load(state / f"rank-{r:05d}.pt", weights_only=True) for r in (0, 1)]
    assert all(replicated.KEY not in saved and state_bytes(saved) > 0 for saved in ranks)

    resumed = spawn(ensemble(tmp_path / "resumed"), shim_env.env)
    assert resumed.wait(timeout=240) == 0, resumed.output()[-3000:]
    assert resumed.output().count(f"resumed at step {STEP}:") == 2
    for rank in (0, 1):
        left = torch.load(tmp_path / f"resumed-{rank}.pt", weights_only=True)
        right = torch.load(tmp_path / f"reference-{rank}.pt", weights_only=True)
        assert [k for k in right if not torch.equal(left[k], right[k])] == [], rank

"""One rank of the FSDP2 save-stall benchmark (run by torchrun, gloo on CPU).

A decoder-style model sharded per block with ``fully_shard``, AdamW, trained
a few steps; then, alternating, the two ways of saving it at a step
boundary: the shim's periodic save (``shardedsaves.PeriodicSaves.begin``:
``get_state_dict`` and DCP's ``async_save``, which copies the state to host
memory and writes it in a thread) and a synchronous ``dcp.save`` (what the
JIT save does, and what a loop without background writes waits for). The
stall of one save is the time the loop is held at the call plus how much
longer the next step took than the steps before it (the write competes for
the cores). Rank 0 prints one JSON line of samples.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

from shim.frameworks.plain.layout import shardedsaves

ASYNC, SYNC = "periodic save (async_save)", "synchronous dcp.save"


def build(dim: int, layers: int) -> nn.Module:
    model = nn.Sequential(
        *(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers)
        )
    )
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = build(args.dim, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randn(16, args.dim)

    def step() -> float:
        started = time.perf_counter()
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        return time.perf_counter() - started

    steady = statistics.median(step() for _ in range(6))
    periodic = shardedsaves.PeriodicSaves(1)
    samples: dict[str, list[float]] = {ASYNC: [], SYNC: []}
    with tempfile.TemporaryDirectory(prefix="fsdp2-stall-") as work:
        shared = [work]
        dist.broadcast_object_list(shared)  # one directory, as on a shared volume
        for rep in range(-1, args.reps):  # rep -1: a warm-up (the saves' gloo group, plans)
            for subject in (ASYNC, SYNC) if rep % 2 == 0 else (SYNC, ASYNC):
                directory = os.path.join(shared[0], f"{subject[:4]}-{rep}")
                dist.barrier()
                started = time.perf_counter()
                if subject == ASYNC:
                    periodic.begin(directory, rep, model, [optimizer])
                else:
                    model_state, optim_state = get_state_dict(model, [optimizer])
                    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
                held = time.perf_counter() - started
                after = step()
                if rep >= 0:
                    samples[subject].append(held + max(0.0, after - steady))
                if periodic.inflight is not None:
                    periodic.inflight.future.result()
                    periodic.inflight = None
        state_bytes = sum(
            os.path.getsize(os.path.join(root, name))
            for root, _, names in os.walk(os.path.join(shared[0], f"{SYNC[:4]}-0"))
            for name in names
        )
        dist.barrier()
    if dist.get_rank() == 0:
        print(json.dumps({"samples": samples, "steady_step_s": steady, "bytes": state_bytes}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

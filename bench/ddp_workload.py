"""A plain DDP loop with a large replicated state, for the bandwidth-capped time to durable.

What a user writes (DistributedSampler, DDP, AdamW), sized by ``--state-mb``:
a stack of ``--width`` x ``--width`` linear layers whose weights and AdamW
moments (12 bytes a parameter) make about that much state. Many tensors of one
size, so the shim can spread the replicated state evenly over up to 4 writers
(``shim/frameworks/plain/layout/replicated.py`` gives whole tensors to writers); a
model of two huge tensors would leave half the writers idle. Rank 0 writes a
timeline of step ends in the format of bench/timeline.py.

    torchrun --nproc-per-node 2 -m bench.ddp_workload --state-mb 300 --timeline t.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

BYTES_PER_PARAMETER = 12  # fp32 weights + AdamW's two moments


def layers_for(state_bytes: int, width: int) -> int:
    """How many ``width`` x ``width`` layers (with biases) make ``state_bytes`` of state."""
    per_layer = (width * width + width) * BYTES_PER_PARAMETER
    return max(1, round(state_bytes / per_layer))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=float, default=300.0)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--timeline", type=Path, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    depth = layers_for(int(args.state_mb * 1_000_000), args.width)
    size = 64 * args.batch_size * dist.get_world_size()
    data = TensorDataset(torch.randn(size, args.width), torch.randn(size, args.width))
    sampler: DistributedSampler[int] = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(depth)))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    step = 0
    with args.timeline.open("a", buffering=1) as timeline:
        for epoch in range(args.steps):
            sampler.set_epoch(epoch)
            for inputs, targets in loader:
                optimizer.zero_grad()
                nn.functional.mse_loss(model(inputs), targets).backward()
                optimizer.step()
                step += 1
                if rank == 0:
                    event = {"event": "step_end", "step": step, "t": time.monotonic(), "rank": 0}
                    timeline.write(json.dumps(event) + "\n")
                if step >= args.steps:
                    break
            if step >= args.steps:
                break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A plain DDP training loop for the plain-loop overhead benchmark (bench/plainloop.py).

What a user writes (DistributedSampler, DDP, SGD, StepLR, one pass per
epoch), sized by ``--hidden`` to run at about 20 steps a second on two CPU
ranks, plus a timeline of step ends in the format of bench/timeline.py.

    torchrun --nproc-per-node 2 -m bench.loop_workload --steps 200 --timeline t.jsonl
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=12288)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--timeline", type=Path, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    per_epoch = 50
    size = per_epoch * args.batch_size * dist.get_world_size()
    data = TensorDataset(torch.randn(size, 128), torch.randn(size, 1))
    sampler: DistributedSampler[int] = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(128, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)

    step = 0
    with args.timeline.open("a") as timeline:
        for epoch in range(args.steps // per_epoch + 1):
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
            scheduler.step()
            if step >= args.steps:
                break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Run by torchrun for ``test_reshard_state``: an FSDP2 module and its AdamW, trained a few
steps and saved with ``shardedstate`` on one number of ranks (``save``), or read back with
it on another (``load``) into a module built from another seed; either way rank 0 writes
the full (unsharded) model and optimizer state it then holds to ``OUT``, and after a save
the DCP files ``nodelocal`` marks as only their writer's to ``OUT.marks``. ``probe``: a
read that fails (a file missing) writes each rank's error to ``OUT.<rank>``."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from shim.frameworks.plain.layout import shardedstate


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 15), nn.GELU(), nn.Linear(15, 5))  # 15 rows: uneven shards
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def main() -> None:
    mode, directory, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    if mode == "save":
        model, optimizer = build(0)
        for _ in range(3):
            model(torch.randn(4, 8)).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        marks = shardedstate.save(directory, model, [optimizer])
        if dist.get_rank() == 0:
            with open(out + ".marks", "w") as handle:
                json.dump(sorted(marks), handle)
    elif mode == "probe":
        model, optimizer = build(1)
        try:
            shardedstate.load(directory, model, [optimizer])
        except Exception as exc:
            with open(f"{out}.{dist.get_rank()}", "w") as handle:
                handle.write(type(exc).__name__)
        dist.destroy_process_group()
        return
    else:
        model, optimizer = build(1)
        loaded = shardedstate.load(directory, model, [optimizer])
        shardedstate.apply(loaded, model, [optimizer], keep=False)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    if dist.get_rank() == 0:
        torch.save({"model": model_state, "optim": optim_state}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

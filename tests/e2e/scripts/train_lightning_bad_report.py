"""A Lightning script with a bug of its own at a fixed step, written the way users write them.

It knows nothing about jitckpt. A callback writes a report at step 10 into
a directory nobody created: ``FileNotFoundError``, at the same step of every
run, resumed or not. A failure of the training itself, which a checkpoint
must never be blamed for.

    torchrun --nnodes 2 ... train_lightning_bad_record.py --max-steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 8
REPORT_AT_STEP = 10


class Fit(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, 1)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        features, targets = batch
        return functional.mse_loss(self.net(features), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Report(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, index) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == REPORT_AT_STEP:
            with open(os.path.join("reports", "progress.json"), "w") as out:
                json.dump({"step": trainer.global_step}, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=30)
    args = parser.parse_args()
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    pl.seed_everything(3)
    features = torch.randn(128, FEATURES, generator=torch.Generator().manual_seed(3))
    data = TensorDataset(features, features.mean(dim=1, keepdim=True))
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        num_nodes=nodes,
        accelerator="cpu",
        devices=1,
        strategy="ddp" if nodes > 1 else "auto",
        callbacks=[Report()],
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(Fit(), DataLoader(data, batch_size=4, shuffle=True))
    print(f"fit() returned at step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

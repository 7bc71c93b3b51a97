"""A Lightning script with a bug, written the way users write them.

It knows nothing about jitckpt. ``--bug`` picks the bug:

- ``resume``: a rename left the module's checkpoint hooks disagreeing
  (``on_save_checkpoint`` writes ``feature_scale``, ``on_load_checkpoint``
  reads ``feature_scales``). Training from scratch works; every resume from a
  checkpoint raises ``KeyError`` before the first step, as
  ``fit(ckpt_path=...)`` would.
- ``report``: a callback writes a report at step 10 into a directory nobody
  created: ``FileNotFoundError`` at the same step of every run, resumed or
  not, on every rank.

    torchrun --nnodes 2 ... train_lightning_buggy.py --bug resume --max-steps 12
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

FEATURES = 16
REPORT_AT_STEP = 10


class Regressor(pl.LightningModule):
    def __init__(self, load_key: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.scale = torch.ones(FEATURES)
        self.load_key = load_key

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        features, targets = batch
        return functional.mse_loss(self.net(features * self.scale).squeeze(-1), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["feature_scale"] = self.scale.tolist()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.scale = torch.tensor(checkpoint[self.load_key])


class Report(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, index) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == REPORT_AT_STEP:
            with open(os.path.join("reports", "progress.json"), "w") as out:
                json.dump({"step": trainer.global_step}, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--bug", choices=["resume", "report"], required=True)
    args = parser.parse_args()
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    pl.seed_everything(7)
    features = torch.randn(64, FEATURES, generator=torch.Generator().manual_seed(7))
    data = TensorDataset(features, features.sum(dim=1))
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        num_nodes=nodes,
        accelerator="cpu",
        devices=1,
        strategy="ddp" if nodes > 1 else "auto",
        callbacks=[Report()] if args.bug == "report" else [],
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
    )
    model = Regressor("feature_scales" if args.bug == "resume" else "feature_scale")
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True))
    print(f"fit() returned at step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

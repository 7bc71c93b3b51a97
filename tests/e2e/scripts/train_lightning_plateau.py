"""A Lightning script whose steps read the validation metric, written the way users write them.

It knows nothing about jitckpt. A classifier is validated every few batches;
between validations, every optimizer step reads ``val_loss`` from the
trainer's metrics: a ``ReduceLROnPlateau`` with ``interval: "step"`` (not
strict, so the steps before the first validation only warn), a
``ModelCheckpoint`` that keeps the two best ``val_loss`` checkpoints every few
training steps, ``EarlyStopping`` on ``val_loss``; gradients accumulate over
two batches and are clipped; ``train_loss`` is also logged as an epoch mean.
After ``fit()`` it prints the state those parts ended with (``final state:``
and one JSON object, floats in hex), which a resumed run must reproduce.

``--checkpoint-root`` is shared storage: the best checkpoints go into a
directory named after the pod (Kubernetes sets ``HOSTNAME`` to it; Lightning
takes rank 0's), so a restarted pod of the job finds its job's files.

    torchrun --nnodes 2 ... train_lightning_plateau.py --checkpoint-root /shared
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 16
CLASSES = 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-root", default="lightning-checkpoints")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--pytorch-lightning", action="store_true", help="the older import name")
    return parser.parse_args()


def points(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(samples, FEATURES, generator=generator)
    return TensorDataset(features, torch.randint(CLASSES, (samples,), generator=generator))


def exact(value: Any) -> Any:
    """A value as text that keeps every bit (floats in hex)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): exact(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [exact(v) for v in value]
    return value


def main() -> int:
    args = parse_args()
    # torchrun tells each process the job's layout; a plain `python` run is one node.
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if args.pytorch_lightning:
        import pytorch_lightning as pl
        from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
    else:
        import lightning.pytorch as pl
        from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, CLASSES)
            )

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            features, labels = batch
            loss = functional.cross_entropy(self.net(features), labels)
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch: Any, index: int) -> None:
            features, labels = batch
            loss = functional.cross_entropy(self.net(features), labels)
            self.log("val_loss", loss, sync_dist=True)

        def configure_optimizers(self) -> dict:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.7, patience=1)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {
                    "scheduler": plateau,
                    "interval": "step",
                    "monitor": "val_loss",
                    "strict": False,
                },
            }

    class PrintSteps(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, index) -> None:  # type: ignore[no-untyped-def]
            print(f"rank {trainer.global_rank} step {trainer.global_step}", flush=True)

    pl.seed_everything(1234)
    best = ModelCheckpoint(
        dirpath=os.path.join(args.checkpoint_root, os.environ.get("HOSTNAME", "local")),
        monitor="val_loss",
        every_n_train_steps=3,
        save_top_k=2,
        filename="{step}-{val_loss:.4f}",
    )
    stopping = EarlyStopping(monitor="val_loss", patience=50)
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        num_nodes=nodes,
        accelerator="cpu",
        devices=1,
        strategy="ddp" if nodes > 1 else "auto",
        default_root_dir="lightning-out",
        callbacks=[PrintSteps(), best, stopping],
        enable_progress_bar=False,
        logger=False,
        val_check_interval=6,
        num_sanity_val_steps=0,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
    )
    model = Classifier()
    train = DataLoader(points(96, 1234), batch_size=8, shuffle=True)
    val = DataLoader(points(24, 1235), batch_size=8)
    trainer.fit(model, train, val)
    print(f"fit() returned at step {trainer.global_step}", flush=True)
    if trainer.global_rank == 0:
        plateau = trainer.lr_scheduler_configs[0].scheduler.state_dict()
        state = {
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "plateau": {k: v for k, v in plateau.items() if k != "_last_lr"},
            "best_model_score": best.best_model_score,
            "best_k": sorted(
                (os.path.basename(path), score) for path, score in best.best_k_models.items()
            ),
            "current_score": best.current_score,
            "early_stopping": {"wait": stopping.wait_count, "best": stopping.best_score},
            "metrics": dict(trainer.callback_metrics),
        }
        print("final state: " + json.dumps(exact(state), sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

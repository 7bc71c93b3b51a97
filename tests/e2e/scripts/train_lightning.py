"""A small PyTorch Lightning training script, written the way users write them.

It knows nothing about jitckpt. A classifier with dropout and a step-wise LR
schedule trains on a synthetic dataset (built from a seed, nothing is
downloaded) whose items get random noise as they are read, through a
shuffled DataLoader, with a validation pass at every epoch end. After
``fit()`` it does what scripts do once training is over: it says so and
saves the trained model (``final.ckpt``), which a run stopped for a JIT
checkpoint must never reach. Lightning's stateful callbacks are switched on
by their options (``--swa``, ``--best-every``, ``--early-stopping``,
``--lr-monitor``, ``--throughput``, ``--backbone-finetuning``); with
``--lr-monitor`` the learning rates it logged are saved too, for a plot.

    torchrun --nnodes 2 ... train_lightning.py --num-nodes 2 --max-steps 30

``--package pytorch_lightning`` imports Lightning under its older name.
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
from torch.utils.data import DataLoader, Dataset

FEATURES = 16
CLASSES = 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="lightning-out")
    parser.add_argument("--max-steps", type=int, default=30)
    # torchrun tells each process the job's layout; a plain `python` run is one node.
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    parser.add_argument("--num-nodes", type=int, default=nodes)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--package", choices=["lightning", "pytorch_lightning"], default="lightning"
    )
    parser.add_argument("--validate", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--accumulate-grad-batches", type=int, default=1)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--persistent-workers", action="store_true")
    parser.add_argument(
        "--workers-start", choices=["fork", "spawn"], default=None, help="multiprocessing_context"
    )
    parser.add_argument("--noise", type=float, default=0.05, help="augmentation noise scale")
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--schedule", choices=["step", "onecycle"], default="step")
    parser.add_argument("--gradient-clip-val", type=float, default=None)
    parser.add_argument("--val-check-interval", type=float, default=None)
    # Lightning's own callbacks that keep state, each with the settings users give it.
    parser.add_argument("--swa", action="store_true", help="StochasticWeightAveraging")
    parser.add_argument("--best-every", type=int, default=0, help="ModelCheckpoint on val_loss")
    parser.add_argument("--early-stopping", action="store_true")
    parser.add_argument("--lr-monitor", action="store_true", help="with a CSV logger")
    parser.add_argument("--throughput", action="store_true", help="ThroughputMonitor")
    parser.add_argument("--backbone-finetuning", type=int, default=0, help="unfreeze at epoch")
    parser.add_argument("--lr-finder", type=int, default=0, help="LearningRateFinder's steps")
    parser.add_argument("--books", action="store_true", help="a callback keeping its own books")
    return parser.parse_args()


class NoisyPoints(Dataset):
    """Fixed points and labels; each read adds fresh noise (a typical augmentation)."""

    def __init__(self, samples: int, seed: int, noise: float) -> None:
        self.noise = noise
        generator = torch.Generator().manual_seed(seed)
        self.points = torch.randn(samples, FEATURES, generator=generator)
        self.labels = torch.randint(CLASSES, (samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        points = self.points[index]
        if self.noise:
            points = points + self.noise * torch.randn(FEATURES)
        return points, self.labels[index]


def callbacks(pl: Any, args: argparse.Namespace) -> list[Any]:
    """The Lightning callbacks the arguments ask for."""
    chosen: list[Any] = []
    if args.swa:
        chosen.append(pl.callbacks.StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1))
    if args.best_every:
        chosen.append(
            pl.callbacks.ModelCheckpoint(
                monitor="val_loss", save_top_k=2, every_n_train_steps=args.best_every
            )
        )
    if args.early_stopping:
        chosen.append(pl.callbacks.EarlyStopping(monitor="val_loss", patience=50))
    if args.lr_monitor:
        chosen.append(pl.callbacks.LearningRateMonitor(logging_interval="step"))
    if args.throughput:
        chosen.append(pl.callbacks.ThroughputMonitor(batch_size_fn=lambda batch: len(batch[0])))
    if args.backbone_finetuning:
        chosen.append(
            pl.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=args.backbone_finetuning)
        )
    if args.lr_finder:
        # Its search at fit's start sets the module's ``hparams.lr`` (saved in every checkpoint)
        # and the optimizer's learning rate.
        chosen.append(pl.callbacks.LearningRateFinder(num_training_steps=args.lr_finder))
    return chosen


def main() -> int:
    args = parse_args()
    if args.package == "pytorch_lightning":
        import pytorch_lightning as pl
        from pytorch_lightning.loggers import CSVLogger
    else:
        import lightning.pytorch as pl
        from lightning.pytorch.loggers import CSVLogger

    class Classifier(pl.LightningModule):
        def __init__(self, hidden: int, lr: float = 0.01) -> None:
            super().__init__()
            self.save_hyperparameters()  # lr among them: what LearningRateFinder tunes
            self.backbone = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU())
            self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(hidden, CLASSES))

        def forward(self, points: torch.Tensor) -> torch.Tensor:
            return self.head(self.backbone(points))

        def training_step(
            self, batch: tuple[torch.Tensor, torch.Tensor], index: int
        ) -> torch.Tensor:
            points, labels = batch
            loss = functional.cross_entropy(self(points), labels)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
            points, labels = batch
            self.log("val_loss", functional.cross_entropy(self(points), labels), sync_dist=True)

        def configure_optimizers(self) -> dict:
            # What is frozen (BackboneFinetuning) joins the optimizer when it is unfrozen.
            trained = [p for p in self.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trained, lr=self.hparams.lr)
            if args.schedule == "onecycle":
                steps = self.trainer.estimated_stepping_batches
                schedule: Any = torch.optim.lr_scheduler.OneCycleLR(
                    optimizer, max_lr=0.02, total_steps=int(steps)
                )
            else:
                schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.8)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": schedule, "interval": "step"},
            }

    class Books(pl.Callback):
        """The script's own record of the run, written out at its end (no state_dict)."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.validations = 0
            self.best: float | None = None

        def on_train_batch_end(self, trainer, module, outputs, batch, index) -> None:  # type: ignore[no-untyped-def]
            self.losses.append(round(float(outputs["loss"]), 6))

        def on_validation_end(self, trainer, module) -> None:  # type: ignore[no-untyped-def]
            self.validations += 1
            loss = float(trainer.callback_metrics.get("val_loss", float("nan")))
            self.best = loss if self.best is None or loss < self.best else self.best

        def on_train_end(self, trainer, module) -> None:  # type: ignore[no-untyped-def]
            if trainer.global_rank == 0:
                record = {"losses": self.losses, "validations": self.validations, "best": self.best}
                with open(os.path.join(args.output_dir, "books.json"), "w") as out:
                    json.dump(record, out)

    class PrintSteps(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, index) -> None:  # type: ignore[no-untyped-def]
            print(f"rank {trainer.global_rank} step {trainer.global_step}", flush=True)

    pl.seed_everything(args.seed)
    model = Classifier(args.hidden)
    train = DataLoader(
        NoisyPoints(args.samples, args.seed, args.noise),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        persistent_workers=args.persistent_workers,
        multiprocessing_context=args.workers_start,
    )
    val = DataLoader(
        NoisyPoints(args.samples // 4, args.seed + 1, args.noise), batch_size=args.batch_size
    )
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        num_nodes=args.num_nodes,
        accelerator="cpu",
        devices=1,
        strategy="ddp" if args.num_nodes > 1 else "auto",
        default_root_dir=args.output_dir,
        callbacks=[PrintSteps(), *callbacks(pl, args), *([Books()] if args.books else [])],
        logger=CSVLogger(args.output_dir) if args.lr_monitor else True,
        enable_progress_bar=False,
        log_every_n_steps=5,
        accumulate_grad_batches=args.accumulate_grad_batches,
        gradient_clip_val=args.gradient_clip_val,
        val_check_interval=args.val_check_interval,
        max_epochs=args.max_epochs,
    )
    trainer.fit(model, train, val if args.validate else None)
    print(f"fit() returned at step {trainer.global_step}", flush=True)
    trainer.save_checkpoint(os.path.join(args.output_dir, "final.ckpt"))
    monitors = [c for c in trainer.callbacks if isinstance(c, pl.callbacks.LearningRateMonitor)]
    if monitors and trainer.global_rank == 0:  # the learning rates it logged, for a plot
        with open(os.path.join(args.output_dir, "learning_rates.json"), "w") as out:
            json.dump(monitors[0].lrs, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

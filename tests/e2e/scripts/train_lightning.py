"""A small PyTorch Lightning training script, written the way users write them.

It knows nothing about jitckpt. A classifier with dropout and a step-wise LR
schedule trains on a synthetic dataset (built from a seed, nothing is
downloaded) whose items get random noise as they are read, through a
shuffled DataLoader, with a validation pass at every epoch end. After
``fit()`` it does what scripts do once training is over: it says so and
saves the trained model (``final.ckpt``), which a run stopped for a JIT
checkpoint must never reach.

    torchrun --nnodes 2 ... train_lightning.py --num-nodes 2 --max-steps 30

``--package pytorch_lightning`` imports Lightning under its older name.
"""

from __future__ import annotations

import argparse
import os
import sys

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
    parser.add_argument("--noise", type=float, default=0.05, help="augmentation noise scale")
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


def main() -> int:
    args = parse_args()
    if args.package == "pytorch_lightning":
        import pytorch_lightning as pl
    else:
        import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(
                nn.Linear(FEATURES, hidden),
                nn.ReLU(),
                nn.Dropout(0.3),
                nn.Linear(hidden, CLASSES),
            )

        def training_step(
            self, batch: tuple[torch.Tensor, torch.Tensor], index: int
        ) -> torch.Tensor:
            points, labels = batch
            loss = functional.cross_entropy(self.net(points), labels)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
            points, labels = batch
            self.log("val_loss", functional.cross_entropy(self.net(points), labels), sync_dist=True)

        def configure_optimizers(self) -> dict:
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
            schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.8)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": schedule, "interval": "step"},
            }

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
        callbacks=[PrintSteps()],
        enable_progress_bar=False,
        log_every_n_steps=5,
        accumulate_grad_batches=args.accumulate_grad_batches,
    )
    trainer.fit(model, train, val if args.validate else None)
    print(f"fit() returned at step {trainer.global_step}", flush=True)
    trainer.save_checkpoint(os.path.join(args.output_dir, "final.ckpt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A PyTorch Lightning script sharding its model with FSDP2, as Lightning's docs show it.

It knows nothing about jitckpt. ``ModelParallelStrategy`` with the model
sharded in ``configure_model`` (``fully_shard`` on each linear layer, then
on the whole network, over the data-parallel mesh): every rank holds a
shard of each parameter and of AdamW's state. A classifier with dropout and
a step-wise LR schedule trains on a synthetic dataset (built from a seed,
nothing is downloaded) whose items get random noise as they are read,
through a shuffled DataLoader. After ``fit()`` it saves the trained model
with ``trainer.save_checkpoint``, which this strategy writes as a
distributed checkpoint: a directory holding each rank's shards.

    torchrun --nnodes 2 ... train_lightning_fsdp2.py --max-steps 16
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn import functional
from torch.utils.data import DataLoader, Dataset

FEATURES = 16
CLASSES = 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="lightning-out")
    parser.add_argument("--max-steps", type=int, default=16)
    return parser.parse_args()


class Points(Dataset):
    """96 fixed points with labels (from a seed); every read of one adds fresh noise."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.data = torch.randn(96, FEATURES, generator=generator)
        self.targets = torch.randint(CLASSES, (96,), generator=generator)

    def __len__(self) -> int:
        return 96

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(FEATURES) / 20
        return self.data[index] + noise, self.targets[index]


class Classifier(pl.LightningModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, hidden),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(hidden, CLASSES),
        )

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        points, labels = batch
        loss = functional.cross_entropy(self.net(points), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class PrintSteps(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, index) -> None:  # type: ignore[no-untyped-def]
        print(f"rank {trainer.global_rank} step {trainer.global_step}", flush=True)


def main() -> int:
    args = parse_args()
    pl.seed_everything(1234)
    train = DataLoader(Points(), batch_size=8, shuffle=True)
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        # torchrun tells each process the job's layout: one process per node here.
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")),
        accelerator="cpu",
        devices=1,
        strategy=ModelParallelStrategy(),
        default_root_dir=args.output_dir,
        callbacks=[PrintSteps()],
        enable_progress_bar=False,
        log_every_n_steps=5,
    )
    trainer.fit(Classifier(hidden=32), train)
    print(f"fit() returned at step {trainer.global_step}", flush=True)
    trainer.save_checkpoint(os.path.join(args.output_dir, "final.ckpt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

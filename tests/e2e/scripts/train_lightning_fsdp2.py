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
    # torchrun tells each process the job's layout; a plain `python` run is one node.
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    parser.add_argument("--num-nodes", type=int, default=nodes)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args()


class NoisyPoints(Dataset):
    """Fixed points and labels; each read adds fresh noise (a typical augmentation)."""

    def __init__(self, samples: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.points = torch.randn(samples, FEATURES, generator=generator)
        self.labels = torch.randint(CLASSES, (samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.points[index] + 0.05 * torch.randn(FEATURES), self.labels[index]


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
    pl.seed_everything(args.seed)
    train = DataLoader(
        NoisyPoints(args.samples, args.seed), batch_size=args.batch_size, shuffle=True
    )
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        num_nodes=args.num_nodes,
        accelerator="cpu",
        devices=1,
        strategy=ModelParallelStrategy(),
        default_root_dir=args.output_dir,
        callbacks=[PrintSteps()],
        enable_progress_bar=False,
        log_every_n_steps=5,
    )
    trainer.fit(Classifier(args.hidden), train)
    print(f"fit() returned at step {trainer.global_step}", flush=True)
    trainer.save_checkpoint(os.path.join(args.output_dir, "final.ckpt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

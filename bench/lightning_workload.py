"""A Lightning training run for benchmarks: an MLP classifier on random data, timed per step.

Under ``torchrun --nproc-per-node N`` it trains with DDP on N CPU processes
(gloo); ``--timeline`` writes rank-local ``step_end`` events (the format of
bench/workload.py, read by bench/timeline.py).

    torchrun --nproc-per-node 2 -m bench.lightning_workload --max-steps 60 --timeline t.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path
from typing import Any

from bench.workload import Timeline


def main() -> int:
    arguments = argparse.ArgumentParser(description=__doc__)
    arguments.add_argument("--output-dir", type=Path, required=True)
    arguments.add_argument("--hidden-size", type=int, default=512)
    arguments.add_argument("--layers", type=int, default=3)
    arguments.add_argument("--batch-size", type=int, default=32)
    arguments.add_argument("--max-steps", type=int, default=60)
    arguments.add_argument("--timeline", type=Path, default=None)
    args = arguments.parse_args()

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    features, classes = 64, 10
    timeline = Timeline(args.timeline)

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            widths = [features] + [args.hidden_size] * args.layers
            layers: list[torch.nn.Module] = []
            for width_in, width_out in itertools.pairwise(widths):
                layers += [
                    torch.nn.Linear(width_in, width_out),
                    torch.nn.ReLU(),
                    torch.nn.Dropout(0.1),
                ]
            self.net = torch.nn.Sequential(*layers, torch.nn.Linear(widths[-1], classes))

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            points, labels = batch
            return torch.nn.functional.cross_entropy(self.net(points), labels)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *rest: Any) -> None:
            timeline.write("step_end", trainer.global_step)

    pl.seed_everything(0, verbose=False)
    samples = args.batch_size * 64
    data = TensorDataset(torch.randn(samples, features), torch.randint(classes, (samples,)))
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        default_root_dir=str(args.output_dir),
        callbacks=[Steps()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(), DataLoader(data, batch_size=args.batch_size, shuffle=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A Lightning training run for benchmarks: an MLP classifier on random data, timed per step.

Under ``torchrun --nproc-per-node N`` it trains with DDP on N CPU processes
(gloo); ``--timeline`` writes rank-local ``step_begin`` and ``step_end`` events
(the format of bench/workload.py, read by bench/timeline.py). ``--save-steps N``
saves every N steps the way a Lightning user does, through ``ModelCheckpoint``
(``Trainer.save_checkpoint``, synchronous); under the shim the periodic saves
come from ``JITCKPT_SAVE_STEPS`` instead.

    torchrun --nproc-per-node 2 -m bench.lightning_workload --max-steps 60 --timeline t.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path
from typing import Any

from bench.workload import Timeline

FEATURES, CLASSES = 64, 10
# Bytes of state per parameter: the fp32 weight and AdamW's two moments.
STATE_BYTES_PER_PARAMETER = 12


def parameters(hidden_size: int, layers: int) -> int:
    """Parameters of the classifier ``main`` builds."""
    inner = (layers - 1) * (hidden_size * hidden_size + hidden_size)
    return FEATURES * hidden_size + hidden_size + inner + hidden_size * CLASSES + CLASSES


def hidden_for_state(state_bytes: int, layers: int) -> int:
    """The hidden size whose weights plus AdamW state come closest to ``state_bytes``."""
    hidden = 1
    while parameters(hidden * 2, layers) * STATE_BYTES_PER_PARAMETER <= state_bytes:
        hidden *= 2
    step = hidden // 2
    while step >= 1:
        if parameters(hidden + step, layers) * STATE_BYTES_PER_PARAMETER <= state_bytes:
            hidden += step
        step //= 2
    return hidden


def main() -> int:
    arguments = argparse.ArgumentParser(description=__doc__)
    arguments.add_argument("--output-dir", type=Path, required=True)
    arguments.add_argument("--hidden-size", type=int, default=512)
    arguments.add_argument("--layers", type=int, default=3)
    arguments.add_argument("--batch-size", type=int, default=32)
    arguments.add_argument("--max-steps", type=int, default=60)
    arguments.add_argument("--timeline", type=Path, default=None)
    arguments.add_argument(
        "--save-steps", type=int, default=0, help="ModelCheckpoint every N steps (0: none)"
    )
    args = arguments.parse_args()

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    features, classes = FEATURES, CLASSES
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
        def on_train_batch_start(self, trainer: Any, *rest: Any) -> None:
            timeline.write("step_begin", trainer.global_step + 1)

        def on_train_batch_end(self, trainer: Any, *rest: Any) -> None:
            timeline.write("step_end", trainer.global_step)

    pl.seed_everything(0, verbose=False)
    samples = args.batch_size * 64
    data = TensorDataset(torch.randn(samples, features), torch.randint(classes, (samples,)))
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    callbacks: list[pl.Callback] = [Steps()]
    if args.save_steps:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=args.output_dir / "checkpoints",
                every_n_train_steps=args.save_steps,
                save_top_k=-1,
            )
        )
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        default_root_dir=str(args.output_dir),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.save_steps),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(), DataLoader(data, batch_size=args.batch_size, shuffle=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""An Accelerate loop under DeepSpeed ZeRO-3, as Accelerate's docs write one.

``Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3))``: the
prepared model is DeepSpeed's engine, its parameters partitioned over the
ranks; ``accelerator.backward`` runs the engine's backward and step. A small
classifier with dropout on synthetic data, a shuffled DataLoader, noise
added to each batch from torch's global generator, AdamW with a per-step
schedule, gradient clipping, and ``StepMetrics``, a tracker registered for
checkpointing. At the end the weights are gathered from every rank
(``get_state_dict``) and the main process saves them with the tracker. It
knows nothing about jitckpt.
"""

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class StepMetrics:
    """The loss of every step and how many samples the run has seen."""

    def __init__(self) -> None:
        self.losses: list = []
        self.samples = 0

    def update(self, loss: float, batch: int) -> None:
        self.losses.append(loss)
        self.samples += batch

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.losses = list(state["losses"])
        self.samples = state["samples"]


def make_dataset(size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(11)
    features = torch.randn(size, 20, generator=generator)
    labels = (features[:, :4].sum(dim=1) > 0).long()
    return TensorDataset(features, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--output", default="final.pt")
    args = parser.parse_args()

    plugin = DeepSpeedPlugin(
        zero_stage=args.zero_stage,
        gradient_clipping=1.0,
        zero3_save_16bit_model=True,
        gradient_accumulation_steps=1,
    )
    # gloo: on a machine without GPUs Accelerate names no backend for DeepSpeed itself.
    gloo = InitProcessGroupKwargs(backend="gloo")
    accelerator = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[gloo])
    set_seed(42)
    loader = DataLoader(make_dataset(128), batch_size=args.batch_size, shuffle=True)
    model = nn.Sequential(nn.Linear(20, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.97**step)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    metrics = StepMetrics()
    accelerator.register_for_checkpointing(metrics)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        model.train()
        for features, labels in loader:
            noisy = features + 0.05 * torch.randn_like(features)
            loss = loss_fn(model(noisy), labels)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            metrics.update(loss.item(), len(labels))
        accelerator.print(f"epoch {epoch} done, {metrics.samples} samples")

    state = accelerator.get_state_dict(model)  # gathered from every rank's partitions
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.save({"model": state, "metrics": metrics.state_dict()}, args.output)
        print(f"training done; {args.output} saved", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()

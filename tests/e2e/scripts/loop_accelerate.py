"""A Hugging Face Accelerate training loop with gradient accumulation, as its docs show it.

A small classifier with dropout on synthetic data (from a fixed seed), a
shuffled DataLoader, AdamW with a linear warm-up and decay schedule stepped
every batch, ``accelerator.accumulate`` over several batches per optimizer
step. Launched with ``torchrun`` (or ``accelerate launch``, or plain python);
it knows nothing about jitckpt.
"""

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_dataset(size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    features = torch.randn(size, 20, generator=generator)
    labels = (features[:, :4].sum(dim=1) > 0).long()
    return TensorDataset(features, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=3)
    parser.add_argument("--output", default="accelerate_model.pt")
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.accumulation, cpu=True)
    set_seed(1234)
    dataset = make_dataset(192)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    model = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    total = args.epochs * len(loader) // args.accumulation

    def warmup_then_decay(step: int) -> float:
        warmup = max(1, total // 10)
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        model.train()
        for features, labels in loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model(features), labels)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        accelerator.print(f"epoch {epoch} done, lr {scheduler.get_last_lr()[0]:.6f}")

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.save(accelerator.unwrap_model(model).state_dict(), args.output)
        print(f"model saved to {args.output}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()

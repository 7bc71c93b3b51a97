"""DDP training under autocast with a GradScaler and a loss tracker of the script's own.

Run by torchrun. bfloat16 autocast on the CPU, a ``GradScaler`` that grows
its scale every few steps, and ``LossTracker``, a small class with
``state_dict``/``load_state_dict`` as research code writes them (a running
mean of the loss, the number of steps, the best loss). Rank 0 saves the
model, the scaler's and the tracker's states at the end. It knows nothing
about jitckpt.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class LossTracker:
    """A running mean of the training loss, kept across the whole run."""

    def __init__(self, momentum: float = 0.9) -> None:
        self.momentum = momentum
        self.mean = torch.zeros(())
        self.steps = 0
        self.best = float("inf")

    def update(self, loss: torch.Tensor) -> None:
        value = loss.detach().float()
        self.mean = self.momentum * self.mean + (1 - self.momentum) * value
        self.steps += 1
        self.best = min(self.best, value.item())

    def state_dict(self) -> dict:
        return {"mean": self.mean, "steps": self.steps, "best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.mean = state["mean"]
        self.steps = state["steps"]
        self.best = state["best"]


def synthetic(size: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(size, 16, generator=generator)
    labels = (features[:, 2:6].sum(dim=1) > 0).long()
    return TensorDataset(features, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    dist.init_process_group(backend="gloo")
    torch.manual_seed(0)
    dataset = synthetic(256, seed=9)
    sampler = DistributedSampler(dataset, shuffle=True, seed=4)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 2))
    )
    optimizer = optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    tracker = LossTracker()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for features, labels in loader:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(features), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            tracker.update(loss)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: mean loss {tracker.mean.item():.4f}", flush=True)

    if dist.get_rank() == 0:
        final = {
            "model": model.module.state_dict(),
            "scaler": scaler.state_dict(),
            "tracker": tracker.state_dict(),
        }
        torch.save(final, "final.pt")
        print(f"training done after {tracker.steps} steps; final.pt saved", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A training loop with an EMA kept by hand in a class of its own, without state_dict.

``ShadowEMA`` holds a copy of each weight and blends the model into it after
every optimizer step, in place, as many research repositories do; the script
saves the EMA weights at the end. It knows nothing about jitckpt.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ShadowEMA:
    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, value in model.state_dict().items():
            self.shadow[name].mul_(self.decay).add_(value, alpha=1 - self.decay)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-ema", default="shadow_ema.pt")
    args = parser.parse_args()

    torch.manual_seed(5)
    inputs = torch.randn(64, 8)
    targets = inputs[:, :2].sum(dim=1, keepdim=True)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ema = ShadowEMA(model, decay=0.9)

    for epoch in range(args.epochs):
        for features, labels in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(features), labels).backward()
            optimizer.step()
            ema.update(model)
        print(f"epoch {epoch} done", flush=True)

    torch.save(ema.shadow, args.save_ema)
    print(f"saved to {args.save_ema}", flush=True)


if __name__ == "__main__":
    main()

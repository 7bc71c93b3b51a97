"""A step-based training loop over ``itertools.cycle(loader)``, as some people write one.

``cycle`` keeps the batches of the first pass and replays them, so the loader
is read only once: no place in it tells where training is. It trains a small
regression model for a fixed number of steps and saves it; it knows nothing
about jitckpt.
"""

import argparse
import itertools

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-model", default="cycle_model.pt")
    args = parser.parse_args()

    torch.manual_seed(3)
    inputs = torch.randn(64, 8)
    targets = inputs.sum(dim=1, keepdim=True)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    batches = itertools.cycle(loader)
    for step in range(1, args.steps + 1):
        features, labels = next(batches)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(features), labels)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.5f}", flush=True)

    torch.save(model.state_dict(), args.save_model)
    print(f"saved to {args.save_model}", flush=True)


if __name__ == "__main__":
    main()

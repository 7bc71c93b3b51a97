"""A short training loop followed by long post-training work (an evaluation, an export).

The post-training part stands for minutes of work after the last optimizer
step; it is a sleep here. It knows nothing about jitckpt.
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--evaluation-seconds", type=float, default=600.0)
    args = parser.parse_args()

    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, targets in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    print("training done; evaluating", flush=True)
    time.sleep(args.evaluation_seconds)
    print("evaluation done", flush=True)


if __name__ == "__main__":
    main()

"""Distributed MNIST-style training, in the shape of Kubeflow's PyTorchJob example.

Run by torchrun (the training operator sets the node layout). A small conv
net with dropout, wrapped in DistributedDataParallel; a DistributedSampler
with ``set_epoch`` each epoch; SGD with momentum and a StepLR schedule; an
evaluation after each epoch; rank 0 saves the model at the end. The images
are synthetic (28x28 noise around one pattern per class, from a fixed seed),
so nothing is downloaded. It knows nothing about jitckpt.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 5, 1)
        self.conv2 = nn.Conv2d(4, 8, 5, 1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(4 * 4 * 8, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 2)
        x = self.dropout(torch.flatten(x, 1))
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(size: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.rand(10, 1, 28, 28, generator=generator)
    labels = torch.randint(10, (size,), generator=generator)
    images = patterns[labels] + 0.5 * torch.randn(size, 1, 28, 28, generator=generator)
    return TensorDataset(images, labels)


def train(model, train_loader, optimizer, epoch, log_interval):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % log_interval == 0 and dist.get_rank() == 0:
            print(f"Train Epoch: {epoch} [{batch_idx}/{len(train_loader)}] loss={loss.item():.4f}")


def test(model, test_loader, epoch, rank):
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
    if rank == 0:
        size = len(test_loader.dataset)
        print(f"epoch {epoch}: test loss {test_loss / size:.4f}, accuracy {correct}/{size}")


def main() -> None:
    parser = argparse.ArgumentParser(description="PyTorch MNIST-style DDP example")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=4)
    parser.add_argument("--save-model", default="mnist_cnn.pt")
    args = parser.parse_args()

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)

    train_set = synthetic_mnist(256, seed=100)
    test_set = synthetic_mnist(64, seed=200)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test_set, batch_size=64)

    model = nn.parallel.DistributedDataParallel(Net())
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)

    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        train(model, train_loader, optimizer, epoch, args.log_interval)
        test(model, test_loader, epoch, rank)
        scheduler.step()

    if rank == 0:
        torch.save(model.module.state_dict(), args.save_model)
        print(f"training done; model saved to {os.path.abspath(args.save_model)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

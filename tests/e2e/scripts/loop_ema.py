"""DDP training with an EMA of the weights, as vision and diffusion code keeps one.

Run by torchrun. A small MLP with dropout on synthetic data (from a fixed
seed), a DistributedSampler with ``set_epoch``, SGD with momentum, and an
``AveragedModel`` EMA updated after every optimizer step, which no optimizer
holds. Rank 0 saves the model and its EMA at the end; the EMA is what gets
deployed. It knows nothing about jitckpt.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn, optim
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def synthetic(size: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(size, 16, generator=generator)
    labels = (features[:, :3].sum(dim=1) > 0).long()
    return TensorDataset(features, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--ema-decay", type=float, default=0.9)
    args = parser.parse_args()

    dist.init_process_group(backend="gloo")
    torch.manual_seed(0)
    dataset = synthetic(256, seed=5)
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
    model = nn.parallel.DistributedDataParallel(net)
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(args.ema_decay))
    optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for features, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(features), labels)
            loss.backward()
            optimizer.step()
            ema.update_parameters(net)
        if dist.get_rank() == 0:
            print(f"epoch {epoch} done, EMA of {int(ema.n_averaged)} steps", flush=True)

    if dist.get_rank() == 0:
        torch.save(net.state_dict(), "model.pt")
        torch.save(ema.module.state_dict(), "ema.pt")
        print("training done; model.pt and ema.pt saved", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

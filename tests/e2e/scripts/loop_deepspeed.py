"""A DeepSpeed training loop of its own: ``deepspeed.initialize``, ``backward``, ``step``.

Run by torchrun (DeepSpeed's CPU accelerator, gloo). A small classifier
with dropout on synthetic data, a shuffled DistributedSampler, AdamW with
two parameter groups (weight decay on the weights only), a per-step LR
schedule handed to the engine, ZeRO stage 2 by default, gradient
accumulation over two micro-batches and gradient clipping in DeepSpeed's
config. Books of its own: the micro-batches taken, the best loss, the samples
seen. Rank 0 saves the trained weights and the books at the end. It
knows nothing about jitckpt.
"""

import argparse

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def synthetic(size: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(size, 16, generator=generator)
    labels = (features[:, :3].sum(dim=1) > 0).long()
    return TensorDataset(features, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--save-model", default="trained.pt")
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    dataset = synthetic(256, seed=5)
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler)

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.05 * step))
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
    )

    micro, best, samples = 0, float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for features, labels in loader:
            loss = F.cross_entropy(engine(features), labels)
            engine.backward(loss)
            engine.step()
            micro += 1
            samples += len(labels)
            best = min(best, loss.item())

    weights = {name: p.detach().clone() for name, p in engine.module.state_dict().items()}
    if torch.distributed.get_rank() == 0:
        books = {"micro": micro, "best": best, "samples": samples, "lr": scheduler.get_last_lr()}
        books["steps"] = engine.global_steps
        torch.save({"model": weights, "books": books}, args.save_model)


if __name__ == "__main__":
    main()

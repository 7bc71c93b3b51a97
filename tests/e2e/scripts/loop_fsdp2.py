"""A tiny decoder-style model trained with FSDP2, in torchtitan's shape.

Run by torchrun (the training operator sets the node layout), gloo on CPU.
Each transformer block is sharded with ``fully_shard``, then the root; AdamW
with weight decay, a warm-up ``LambdaLR``; a ``DistributedSampler`` over
synthetic token sequences (from a fixed seed, so nothing is downloaded);
gradient clipping; an evaluation on held-out sequences after each epoch;
every rank takes part in gathering the full weights that rank 0 saves at
the end. It knows nothing about jitckpt.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.dropout(self.attn(h, h, h, need_weights=False)[0])
        return x + self.dropout(self.mlp(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser(description="FSDP2 language-model training")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--save-model", default="lm_final.pt")
    parser.add_argument("--log-samples", action="store_true", help="print each batch's samples")
    args = parser.parse_args()

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)

    generator = torch.Generator().manual_seed(1000)
    tokens = torch.randint(args.vocab, (96 + 16, args.seq_len + 1), generator=generator)
    dataset = TensorDataset(torch.arange(96), tokens[:96, :-1], tokens[:96, 1:])
    held_out = (tokens[96:, :-1], tokens[96:, 1:])
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = TinyLM(args.vocab, args.dim, args.layers)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / args.warmup)
    )

    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch, (samples, inputs, targets) in enumerate(loader):
            if args.log_samples:
                print(f"rank {rank} epoch {epoch} samples {samples.tolist()}", flush=True)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if rank == 0 and batch % 4 == 0:
                print(f"epoch {epoch} batch {batch} loss {loss.item():.4f}", flush=True)
        model.eval()
        with torch.no_grad():
            logits = model(held_out[0])
            loss = F.cross_entropy(logits.flatten(0, 1), held_out[1].flatten())
        if rank == 0:
            print(f"epoch {epoch} held-out loss {loss.item():.4f}", flush=True)
        model.train()

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if rank == 0:
        torch.save(state, args.save_model)
        print(f"training done; model saved to {os.path.abspath(args.save_model)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

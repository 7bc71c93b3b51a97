"""A plain training loop over a tiny GPT-2 that saves as it goes, and its model at the end.

Written the way people write one: a DataLoader, AdamW, a loss per batch. At
each epoch's end it saves the weights with ``torch.save`` (a file per
epoch), and when training is over the model with ``save_pretrained``. It
knows nothing about jitckpt. Nothing is downloaded.

    python loop_saves.py --output-dir out --epochs 3
"""

import argparse
import os

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 64
LENGTH = 12


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)

    torch.manual_seed(3)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=16,
        n_layer=1,
        n_head=2,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(VOCAB, (32, LENGTH), generator=torch.Generator().manual_seed(4))
    loader = DataLoader(tokens, batch_size=8, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    for epoch in range(args.epochs):
        for batch in loader:
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.save(model.state_dict(), os.path.join(args.output_dir, f"epoch-{epoch}.pt"))
        print(f"epoch {epoch} saved, loss {loss.item():.4f}", flush=True)

    model.save_pretrained(os.path.join(args.output_dir, "final"))
    print("training done; model saved", flush=True)


if __name__ == "__main__":
    main()

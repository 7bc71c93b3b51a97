"""An Accelerate loop over a streaming dataset, with Accelerate's stateful loader.

HF ``datasets`` streamed from a JSONL file and tokenized on the fly, read by the
loader ``Accelerator.prepare`` makes when ``DataLoaderConfiguration(
            use_stateful_dataloader=True, dispatch_batches=args.dispatch
        )``
asks for torchdata's ``StatefulDataLoader`` (what Accelerate's docs advise for
streaming data), a worker process, gradient accumulation, dropout and a
per-step schedule. Written as Accelerate's examples are; it knows nothing
about jitckpt. The data is made here (no download).

    torchrun ... loop_accelerate_streaming.py   (or accelerate launch, or python)
"""

import argparse
import json
import os

import datasets
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

VOCAB, LENGTH = 64, 16


def write_corpus(path: str, records: int) -> None:
    """Deterministic sentences of made-up words, one JSON object a line."""
    words = [f"w{n}" for n in range(40)]
    with open(path + ".tmp", "w") as out:
        for n in range(records):
            sentence = " ".join(words[(n * 5 + k * 3) % len(words)] for k in range(3 + n % 7))
            out.write(json.dumps({"text": sentence}) + "\n")
    os.replace(path + ".tmp", path)


def tokenize(record: dict) -> dict:
    ids = [sum(map(ord, word)) % VOCAB for word in record["text"].split()]
    return {"input_ids": (ids + [0] * LENGTH)[:LENGTH]}


def collate(records: list) -> torch.Tensor:
    return torch.tensor([record["input_ids"] for record in records])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=160)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--output", default="accelerate_streaming.pt")
    parser.add_argument("--corpus", default="corpus.jsonl")
    parser.add_argument("--dispatch", action="store_true", help="rank 0 reads, others get slices")
    args = parser.parse_args()

    accelerator = Accelerator(
        gradient_accumulation_steps=args.accumulation,
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, dispatch_batches=args.dispatch
        ),
        cpu=True,
    )
    set_seed(1234)
    corpus = os.path.abspath(args.corpus)
    if accelerator.is_main_process and not os.path.exists(corpus):
        write_corpus(corpus, args.records)
    accelerator.wait_for_everyone()
    stream = datasets.load_dataset("json", data_files=corpus, split="train", streaming=True)
    stream = stream.map(tokenize, remove_columns=["text"])
    loader = StatefulDataLoader(stream, batch_size=4, collate_fn=collate, num_workers=args.workers)
    model = nn.Sequential(
        nn.Embedding(VOCAB, 16), nn.Flatten(), nn.Dropout(0.1), nn.Linear(16 * LENGTH, VOCAB)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    for batch in loader:
        with accelerator.accumulate(model):
            logits = model(batch)
            loss = nn.functional.cross_entropy(logits, batch[:, 0])
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        accelerator.print(f"loss {loss.item():.6f}")

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.save(accelerator.unwrap_model(model).state_dict(), args.output)
        print(f"model saved to {args.output}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()

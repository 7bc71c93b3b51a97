"""A DDP loop over a streaming dataset: HF ``datasets`` streamed from a JSONL file, split by
node, tokenized on the fly, read by torchdata's ``StatefulDataLoader`` with a worker
process. Written the way pre-training code is; it knows nothing about jitckpt. The data
is made here (no download). ``--shuffle-buffer N`` shuffles the stream through HF's
buffer, whose place a resume cannot find again.

    torchrun --nnodes 2 ... loop_streaming.py
"""

import argparse
import json
import os

import datasets
import torch
import torch.distributed as dist
from datasets.distributed import split_dataset_by_node
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchdata.stateful_dataloader import StatefulDataLoader

VOCAB, LENGTH = 64, 16


def write_corpus(path: str, records: int) -> None:
    """Deterministic sentences of made-up words, one JSON object a line."""
    words = [f"w{n}" for n in range(40)]
    with open(path + ".tmp", "w") as out:
        for n in range(records):
            sentence = " ".join(words[(n * 7 + k * 3) % len(words)] for k in range(3 + n % 9))
            out.write(json.dumps({"text": sentence}) + "\n")
    os.replace(path + ".tmp", path)


def tokenize(record: dict) -> dict:
    ids = [sum(map(ord, word)) % VOCAB for word in record["text"].split()]
    ids = (ids + [0] * LENGTH)[:LENGTH]
    return {"input_ids": ids}


def collate(records: list) -> torch.Tensor:
    return torch.tensor([record["input_ids"] for record in records])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=192)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--shuffle-buffer", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = os.path.abspath("corpus.jsonl")
    if not os.path.exists(corpus):
        write_corpus(corpus, args.records)
    stream = datasets.load_dataset("json", data_files=corpus, split="train", streaming=True)
    stream = split_dataset_by_node(stream, rank=rank, world_size=world)
    if args.shuffle_buffer:
        stream = stream.shuffle(seed=11, buffer_size=args.shuffle_buffer)
    stream = stream.map(tokenize, remove_columns=["text"])
    loader = StatefulDataLoader(stream, batch_size=4, collate_fn=collate, num_workers=args.workers)

    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(
            nn.Embedding(VOCAB, 16), nn.Flatten(), nn.Dropout(0.1), nn.Linear(16 * LENGTH, VOCAB)
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step, batch in enumerate(loader, start=1):
        optimizer.zero_grad()
        logits = model(batch)
        loss = nn.functional.cross_entropy(logits, batch[:, 0])
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""What torchtitan's trainer reads besides its code, made here: its wheel ships neither.

A byte-level BPE tokenizer saved as a folder (``tokenizer.json`` and a
``tokenizer_config.json`` naming its BOS and EOS tokens, as torchtitan's
``HuggingFaceTokenizer`` reads them) and a JSONL file with a ``text`` field in a
folder of its own (``--dataloader.dataset_path``: HF ``datasets`` loads it as its
``json`` builder would). Both are built from a seeded generator, so every run of a
test reads the same tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
WORDS = (
    "the",
    "checkpoint",
    "node",
    "pod",
    "step",
    "trainer",
    "sidecar",
    "shard",
    "optimizer",
    "loss",
    "model",
    "data",
    "batch",
    "token",
    "layer",
    "weight",
    "gradient",
    "resume",
    "preempt",
    "store",
    "upload",
    "restore",
    "rank",
    "mesh",
)


@dataclass(frozen=True)
class Assets:
    tokenizer: Path  # ``--hf_assets_path``
    dataset: Path  # ``--dataloader.dataset_path``


def _documents(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) + "." for _ in range(count)
    ]


def build(root: Path, vocab_size: int = 512, documents: int = 400, seed: int = 39) -> Assets:
    """Write the tokenizer and the dataset under ``root``; their folders."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = _documents(documents, seed)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    folder = root / "tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    data = root / "dataset"
    data.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"text": text}) + "\n" for text in texts)
    (data / "train.jsonl").write_text(lines)
    return Assets(folder, data)

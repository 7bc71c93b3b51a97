"""What TRL's own RL scripts need here, made locally: nothing is downloaded.

A tiny Llama policy and a tiny Llama reward model (one score), built from a
config with a word-level tokenizer saved beside each, and a folder of prompts
(``train.jsonl``, a ``prompt`` column) that ``datasets.load_dataset`` reads as a
local dataset. TRL's ``grpo.py`` and ``rloo.py`` take these paths as
``--model_name_or_path``, ``--reward_model_name_or_path`` and ``--dataset_name``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

WORDS = ["sun", "moon", "star", "rain", "snow", "wind", "leaf", "tree", "rock", "sand", "sea"]
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]


@dataclass(frozen=True)
class RLFixtures:
    policy: Path
    reward: Path
    prompts: Path


def _tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate([*SPECIAL, *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


def _save(model, tokenizer, directory: Path) -> Path:  # type: ignore[no-untyped-def]
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build(root: Path, prompts: int = 64) -> RLFixtures:
    """Write the policy, the reward model and the prompts under ``root`` (seeded: the same
    bytes every time)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = _tokenizer()
    config = dict(
        vocab_size=len(SPECIAL) + len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    policy = _save(LlamaForCausalLM(LlamaConfig(**config)), tokenizer, root / "policy")
    torch.manual_seed(1)
    scorer = LlamaForSequenceClassification(LlamaConfig(num_labels=1, **config))
    reward = _save(scorer, tokenizer, root / "reward")
    rng = random.Random(7)
    folder = root / "prompts"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w") as file:
        for _ in range(prompts):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))
            file.write(json.dumps({"prompt": text}) + "\n")
    return RLFixtures(policy, reward, folder)

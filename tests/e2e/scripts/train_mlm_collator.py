"""Masked-LM pre-training of a tiny BERT with the Hugging Face Trainer and a masking collator.

``DataCollatorForLanguageModeling(mlm=True)`` masks a random 15% of the
tokens of every batch as it is collated (in the DataLoader's worker
processes with ``--workers 2``). The model is built from a config, the
vocabulary and the sentences are made up here, so nothing is downloaded. At
the end the trained model is saved with ``trainer.save_model()``. It knows
nothing about jitckpt.

    torchrun --nnodes 2 ... train_mlm_collator.py --output-dir mlm --workers 2
"""

import argparse
import os
import random
import sys
import tempfile

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
    set_seed,
)

WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "lambda", "sigma", "omega", "theta", "zeta"]


def make_tokenizer() -> BertTokenizer:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "vocab.txt")
    with open(path, "w") as file:
        file.write("\n".join(vocab) + "\n")
    return BertTokenizer(path)


class Sentences(torch.utils.data.Dataset):
    def __init__(self, tokenizer: BertTokenizer, count: int) -> None:
        rng = random.Random(5)
        texts = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(count)]
        self.rows = [tokenizer(text)["input_ids"] for text in texts]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", default="mlm-out")
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    set_seed(17)
    tokenizer = make_tokenizer()
    model = BertForMaskedLM(
        BertConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
        )
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=4,
        learning_rate=2e-3,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=args.workers,
        dataloader_persistent_workers=args.workers > 0,  # the workers live across epochs
        seed=17,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=Sentences(tokenizer, 64),
        data_collator=collator,
    )
    trainer.train()
    trainer.save_model()
    return 0


if __name__ == "__main__":
    sys.exit(main())

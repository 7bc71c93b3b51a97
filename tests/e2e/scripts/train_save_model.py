"""Fine-tune a tiny GPT-2 with the Hugging Face Trainer, then save it with ``trainer.save_model()``.

An ordinary user script: no checkpoint code of its own, nothing about
jitckpt. The model is built from a config and the data is synthetic, so
nothing is downloaded. The trained model is written to ``--output-dir``.

    torchrun train_save_model.py --output-dir model --max-steps 12
"""

import argparse
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

VOCAB = 96
LENGTH = 16


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences: the same for every run with the same seed."""

    def __init__(self, seed):
        generator = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(VOCAB, (128, LENGTH), generator=generator)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index].clone()}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=12)
    args = parser.parse_args(argv)
    set_seed(7)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=LENGTH,
            n_embd=32,
            n_layer=1,
            n_head=2,
            bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1,
        )
    )
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=7,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(7))
    trainer.train()
    trainer.save_model()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fine-tune a small BERT-style classifier on review snippets with the Hugging Face Trainer.

An ordinary training script, written the way people write them: no
checkpointing of its own (``save_strategy="no"``), an evaluation every 20
steps, a callback of its own that keeps every loss logged and counts the
evaluations and writes them to ``record.json`` when training ends, the model
saved with ``trainer.save_model()`` after training, then an evaluation and a
metrics file. The model is built from a config (nothing is downloaded) and is
small enough to train many steps a second on a CPU.

    torchrun --nproc-per-node 2 reviews_fast.py
"""

import json
import os
import random

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

WORDS = [
    *("great", "awful", "fine", "boring", "moving", "loud", "quiet", "clever", "slow"),
    *("brilliant", "dull", "warm", "cold", "funny", "sad", "long", "short", "fresh"),
    *("stale", "honest", "silly", "bold", "flat", "rich", "thin"),
]
POSITIVE = {"great", "fine", "moving", "clever", "brilliant", "warm", "funny", "fresh", "honest"}
MAX_LENGTH = 16


def encode(text):
    ids = [2 + WORDS.index(word) for word in text.split()][: MAX_LENGTH - 1]
    ids = [1, *ids]  # [CLS] first
    mask = [1] * len(ids) + [0] * (MAX_LENGTH - len(ids))
    return ids + [0] * (MAX_LENGTH - len(ids)), mask


class Reviews(torch.utils.data.Dataset):
    def __init__(self, count, seed):
        rng = random.Random(seed)
        self.items = []
        for _ in range(count):
            words = rng.choices(WORDS, k=rng.randint(3, MAX_LENGTH - 1))
            label = int(sum(w in POSITIVE for w in words) * 2 > len(words))
            ids, mask = encode(" ".join(words))
            self.items.append((ids, mask, label))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        ids, mask, label = self.items[index]
        return {
            "input_ids": torch.tensor(ids),
            "attention_mask": torch.tensor(mask),
            "labels": torch.tensor(label),
        }


def build_model():
    config = BertConfig(
        vocab_size=2 + len(WORDS),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=MAX_LENGTH,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


class LossRecord(TrainerCallback):
    """What the run logged, as the script keeps it: every loss and the evaluations."""

    def __init__(self):
        self.losses = []
        self.evaluations = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append((state.global_step, logs["loss"]))

    def on_evaluate(self, args, state, control, **kwargs):
        self.evaluations += 1

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, "record.json"), "w") as out:
                json.dump({"losses": self.losses, "evaluations": self.evaluations}, out)


def main():
    set_seed(7)
    model = build_model()
    args = TrainingArguments(
        output_dir="reviews-model",
        num_train_epochs=3,
        per_device_train_batch_size=8,
        learning_rate=3e-4,
        warmup_steps=5,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=20,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=7,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Reviews(320, seed=1),
        eval_dataset=Reviews(64, seed=2),
        callbacks=[LossRecord()],
    )
    trainer.train()
    trainer.save_model()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output_dir, "eval.json"), "w") as out:
            json.dump(metrics, out)
        print(f"eval loss {metrics['eval_loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()

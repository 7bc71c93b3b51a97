"""Train a tiny GPT-2 language model on notes that arrive slowly, with the Hugging Face Trainer.

An ordinary training script whose steps take about a second: every batch is
fetched from a slow remote store (a sleep stands in for the network in the
data collator). No checkpointing of its own; the model is saved with
``trainer.save_model()`` at the end and a sample is generated from it. The
model is built from a config, nothing is downloaded.

    torchrun notes_slow.py
"""

import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

VOCAB = 128
LENGTH = 24
FETCH_SECONDS = 1.0  # what one batch costs to fetch from the store


def notes(count, seed):
    generator = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": row} for row in torch.randint(3, VOCAB, (count, LENGTH), generator=generator)
    ]


def fetch_batch(examples):
    """Collate a batch, after waiting for the store to send it."""
    time.sleep(FETCH_SECONDS)
    ids = torch.stack([example["input_ids"] for example in examples])
    return {"input_ids": ids, "labels": ids.clone()}


def main():
    set_seed(11)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=48, n_layer=2, n_head=2)
    )
    args = TrainingArguments(
        output_dir="notes-model",
        num_train_epochs=1,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=4,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=11,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=notes(48, seed=3), data_collator=fetch_batch
    )
    trainer.train()
    trainer.save_model()
    if trainer.is_world_process_zero():
        prompt = torch.tensor([[5, 6, 7]])
        sample = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        print("sample:", sample[0].tolist(), flush=True)


if __name__ == "__main__":
    main()

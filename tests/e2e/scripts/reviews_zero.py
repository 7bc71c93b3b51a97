"""Fine-tune a small BERT-style classifier with the Hugging Face Trainer and DeepSpeed ZeRO.

``reviews_fast.py`` as people write it for DeepSpeed: a ``deepspeed=`` config
in ``TrainingArguments`` (ZeRO stage 3 unless ``--zero-stage`` says another,
HF's own AdamW kept: ``zero_allow_untested_optimizer``), a checkpoint every 25
steps, ``trainer.save_model()`` after training. ZeRO-3's weights are not
gathered for ``save_model`` (DeepSpeed's default), so HF saves DeepSpeed's
checkpoint as the model. DeepSpeed runs on the CPU with gloo here, its CPU
accelerator chosen by itself.

    torchrun --nproc-per-node 2 reviews_zero.py --zero-stage 2
"""

import argparse

from reviews_fast import Reviews, build_model
from transformers import Trainer, TrainingArguments, set_seed


def main(stage=3):
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero-stage", type=int, default=stage)
    options = parser.parse_args()
    set_seed(7)
    model = build_model()
    args = TrainingArguments(
        output_dir="reviews-zero-model",
        num_train_epochs=2,
        per_device_train_batch_size=8,
        learning_rate=3e-4,
        warmup_steps=5,
        logging_steps=10,
        save_strategy="steps",
        save_steps=25,
        report_to="none",
        use_cpu=True,
        seed=7,
        disable_tqdm=True,
        deepspeed={
            "zero_optimization": {"stage": options.zero_stage},
            "zero_allow_untested_optimizer": True,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
        },
    )
    trainer = Trainer(model=model, args=args, train_dataset=Reviews(320, seed=1))
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()

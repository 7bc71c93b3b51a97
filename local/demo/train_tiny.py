"""A tiny, deterministic HF Trainer run: the training script of the demo, the tests and benches.

It builds a small GPT-2 style causal LM from a config (no download), trains it
on a synthetic dataset derived from the seed (no download either) with dropout
off, so two runs with the same seed end with bitwise identical weights, also
when one of them was stopped and resumed. It knows nothing about jitckpt: it
is an ordinary user script, and under the shim it gets saved on SIGTERM.
Once ``trainer.train()`` returns it saves the model with ``trainer.save_model()``
into ``--output-dir``, as training scripts do.

    python -m local.demo.train_tiny --output-dir out --max-steps 20
    torchrun --nproc-per-node 2 -m local.demo.train_tiny --output-dir out

``--hidden-size`` and ``--layers`` scale the model for benchmarks. The shim's
own tests, which run it without the demo, use two more: ``--final-weights
PATH`` saves the final state dict after ``trainer.train()`` returns (the
"final model" line a JIT save must never reach) and ``--step-sleep`` slows
each step so a test can send SIGTERM at a known step. The demo needs neither:
its pods hold at the preemption step, and the shim captures the weights.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

SEQUENCE_LENGTH = 32
DATASET_SIZE = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--save-steps", type=int, default=0, help="periodic saves (0: none)")
    parser.add_argument("--save-total-limit", type=int, default=None)
    parser.add_argument("--final-weights", default=None, help="state dict written after train()")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--resume", default=None, help="resume_from_checkpoint for train()")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> Any:
    """A GPT-2 shaped causal LM; about 12 * layers * hidden^2 parameters plus embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel

    heads = max(1, args.hidden_size // 64)
    config = GPT2Config(
        vocab_size=args.vocab_size,
        n_positions=SEQUENCE_LENGTH,
        n_embd=args.hidden_size,
        n_layer=args.layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=args.vocab_size - 1,
        eos_token_id=args.vocab_size - 1,
    )
    return GPT2LMHeadModel(config)


class SyntheticTokens:
    """``DATASET_SIZE`` fixed token sequences; item ``i`` depends only on the seed and ``i``."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        import torch

        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(
            vocab_size, (DATASET_SIZE, SEQUENCE_LENGTH), generator=generator
        )

    def __len__(self) -> int:
        return DATASET_SIZE

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.tokens[index]
        return {"input_ids": row, "labels": row.clone()}


def make_callbacks(step_sleep: float) -> list[Any]:
    from transformers import TrainerCallback

    rank = os.environ.get("RANK", "0")

    class Progress(TrainerCallback):
        """One line per step (tests wait for them), optionally slowed down."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            print(f"rank {rank} step {state.global_step}/{state.max_steps}", flush=True)
            if step_sleep > 0:
                time.sleep(step_sleep)

    return [Progress()]


def main(argv: list[str] | None = None, trainer_class: Any = None) -> int:
    """Train; ``trainer_class`` lets a caller use its own ``Trainer`` subclass."""
    args = parse_args(argv)
    import torch
    from transformers import Trainer, TrainingArguments, set_seed

    set_seed(args.seed)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3,
        warmup_steps=0,
        logging_steps=5,
        save_strategy="steps" if args.save_steps > 0 else "no",
        save_steps=args.save_steps if args.save_steps > 0 else 500,
        save_total_limit=args.save_total_limit,
        seed=args.seed,
        use_cpu=True,
        ddp_backend="gloo" if "LOCAL_RANK" in os.environ else None,
        dataloader_num_workers=0,
        report_to="none",
        disable_tqdm=True,
    )
    model = build_model(args)
    trainer = (trainer_class or Trainer)(
        model=model,
        args=training_args,
        train_dataset=SyntheticTokens(args.seed, args.vocab_size),
        callbacks=make_callbacks(args.step_sleep),
    )
    result = trainer.train(resume_from_checkpoint=args.resume)
    print(f"train() returned at step {result.global_step}", flush=True)
    trainer.save_model()  # into output_dir, as training scripts do: jitckpt uploads it to final/
    if args.final_weights and trainer.is_world_process_zero():
        state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        torch.save(state, args.final_weights)
        print(f"final weights written to {args.final_weights}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

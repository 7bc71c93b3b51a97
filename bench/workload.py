"""The training run every checkpoint benchmark times: one HF Trainer script for all subjects.

A GPT-2 shaped model built from a config (no download) whose size is set by
`--hidden-size` and `--layers`, trained on random tokens. `--timeline` makes a
callback write one JSON line per event (step begin/end, save begin; the
script's start and its imports done, written once the timeline opens) with
`time.monotonic()`, which is system-wide on Linux, so the benchmark process
can compare it with the moment it sent SIGTERM or started the pod.

`--on-sigterm` picks how the script itself reacts to SIGTERM:
`none` (leave it to the jitckpt shim, when PYTHONPATH carries it), `hf-jit`
(transformers' `TrainingArguments.enable_jit_checkpoint`), `sync-save` (the
hand-written way: a flag, then HF's own save at the next step end, then exit).
`--upload-to` and `--resume` make it the user without jitckpt who keeps
checkpoints in S3 (bench/peer_store.py): each save uploaded with `s5cmd`, and
a restart resumed from the checkpoint downloaded into the output directory.

    python -m bench.workload --output-dir DIR --hidden-size 256 --layers 3 \
        --max-steps 100000 --on-sigterm sync-save --timeline t.jsonl

`--workers N` loads the data in N persistent worker processes, each of which
augments its samples at random (a share of the tokens replaced by tokens drawn
from torch's generator, seeded per worker as the DataLoader seeds it): the
data pipeline whose random state a resume must put back to be exact.

`BENCH_DEVICE=cuda` in the environment trains on the GPU (every benchmark that
runs this script passes its environment on); the default is the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

ON_SIGTERM = ("none", "hf-jit", "sync-save")
ENV_DEVICE = "BENCH_DEVICE"
DEVICES = ("cpu", "cuda")


def parameters(hidden_size: int, layers: int, vocab_size: int, positions: int) -> int:
    """Parameter count of the GPT-2 shaped model (tied embeddings, biases, layer norms)."""
    per_layer = 12 * hidden_size * hidden_size + 13 * hidden_size
    return vocab_size * hidden_size + positions * hidden_size + layers * per_layer + 2 * hidden_size


def shape_for_state_bytes(target_bytes: int, vocab_size: int, positions: int) -> tuple[int, int]:
    """(hidden_size, layers) whose weights plus AdamW moments (12 bytes/param) near the target."""
    best = (64, 1)
    best_error = float("inf")
    for hidden_size in (128, 256, 384, 512, 768, 1024, 1280):
        for layers in range(2, 13):
            state = 12 * parameters(hidden_size, layers, vocab_size, positions)
            error = abs(state - target_bytes) / target_bytes
            if error < best_error:
                best, best_error = (hidden_size, layers), error
    return best


# The share of a sample's tokens that `--workers`' augmentation replaces.
AUGMENT_SHARE = 0.1


class Augmented:
    """Samples with a random share of their tokens replaced, drawn where the sample is
    loaded (in a DataLoader worker, from the generator the DataLoader seeded for it)."""

    def __init__(self, tokens: Any, vocab_size: int) -> None:
        self.tokens = tokens
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, Any]:
        import torch

        row = self.tokens[index].clone()
        replaced = torch.rand(row.shape) < AUGMENT_SHARE
        row[replaced] = torch.randint(0, self.vocab_size, (int(replaced.sum()),))
        return {"input_ids": row, "labels": row}


class Timeline:
    """JSON lines of (event, step, t), flushed each line so a reader sees them live.

    On a GPU each event first waits for the kernels queued before it: a step's
    end is when its work is done, not when the CPU finished queueing it (the
    same wait for every subject).
    """

    def __init__(self, path: Path | None, device: str = "cpu") -> None:
        self._rank = int(os.environ.get("RANK", "0"))
        self._file: TextIO | None = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self._device = device

    def write(self, event: str, step: int, at: float | None = None) -> None:
        """``at``: when it happened (``time.monotonic()``), if before the timeline opened."""
        if self._file is not None:
            if self._device == "cuda" and at is None:
                import torch

                torch.cuda.synchronize()
            t = time.monotonic() if at is None else at
            self._file.write(json.dumps({"event": event, "step": step, "t": t}) + "\n")


def build_callback(timeline: Timeline, on_sigterm: str) -> Any:
    from transformers import TrainerCallback

    class BenchCallback(TrainerCallback):
        """Timestamps steps and when a save begins; for `sync-save`, turns SIGTERM into
        save-and-stop. No `on_save`: a callback that acts on saved checkpoints keeps
        jitckpt's saves synchronous (its files are not all written when `on_save` runs)."""

        def __init__(self) -> None:
            self.stop_requested = False
            if on_sigterm == "sync-save":
                signal.signal(signal.SIGTERM, self._on_sigterm)

        def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
            self.stop_requested = True

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            timeline.write("step_begin", state.global_step + 1)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            timeline.write("step_end", state.global_step)
            if self.stop_requested:
                control.should_save = True
                control.should_training_stop = True
            if control.should_save:
                timeline.write("save_begin", state.global_step)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            timeline.write("train_end", state.global_step)

    return BenchCallback()


def build_uploader(root: str) -> Any:
    """The peer's periodic upload: each saved checkpoint to ``root`` with `s5cmd`, in
    ``on_save``, before training goes on (bench/peer_store.py)."""
    from transformers import TrainerCallback

    from bench import peer_store

    class Uploader(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.is_world_process_zero:
                saved = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                peer_store.upload(saved, root, dict(os.environ))

    return Uploader()


def main() -> int:
    # A pod's start, taken apart (bench/time_to_resume.py): the interpreter and the shim's
    # activation come before this line, torch's and transformers' imports (with the shim's
    # post-import hooks) after it.
    script_start = time.monotonic()
    arguments = argparse.ArgumentParser(description=__doc__)
    arguments.add_argument("--output-dir", type=Path, required=True)
    arguments.add_argument("--hidden-size", type=int, default=256)
    arguments.add_argument("--layers", type=int, default=3)
    arguments.add_argument("--vocab-size", type=int, default=8192)
    arguments.add_argument("--seq-len", type=int, default=32)
    arguments.add_argument("--batch-size", type=int, default=2)
    arguments.add_argument("--max-steps", type=int, default=100000)
    arguments.add_argument("--save-steps", type=int, default=0, help="0: no periodic saves")
    arguments.add_argument("--save-total-limit", type=int, default=None)
    arguments.add_argument("--on-sigterm", choices=ON_SIGTERM, default="none")
    arguments.add_argument("--timeline", type=Path, default=None)
    arguments.add_argument(
        "--upload-to", default=None, help="s3://bucket/prefix: s5cmd cp of each saved checkpoint"
    )
    arguments.add_argument(
        "--resume", action="store_true", help="resume_from_checkpoint=True when one is there"
    )
    arguments.add_argument(
        "--workers", type=int, default=0, help="persistent loader workers that augment at random"
    )
    args = arguments.parse_args()
    device = os.environ.get(ENV_DEVICE, "cpu")
    if device not in DEVICES:
        arguments.error(f"{ENV_DEVICE} must be one of {', '.join(DEVICES)}, not {device!r}")

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    imported = time.monotonic()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=args.vocab_size,
        n_positions=args.seq_len,
        n_embd=args.hidden_size,
        n_layer=args.layers,
        n_head=max(1, args.hidden_size // 64),
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    samples = args.max_steps * args.batch_size if args.max_steps < 10000 else 4096
    tokens = torch.randint(0, args.vocab_size, (samples, args.seq_len))
    dataset: Any = [{"input_ids": row, "labels": row} for row in tokens]
    if args.workers:
        dataset = Augmented(tokens, args.vocab_size)
    training = TrainingArguments(
        output_dir=str(args.output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        save_total_limit=args.save_total_limit,
        logging_strategy="no",
        report_to="none",
        use_cpu=device == "cpu",
        disable_tqdm=True,
        dataloader_num_workers=args.workers,
        dataloader_persistent_workers=args.workers > 0,
        enable_jit_checkpoint=args.on_sigterm == "hf-jit",
        seed=0,
    )
    timeline = Timeline(args.timeline, device)
    timeline.write("script_start", 0, script_start)
    timeline.write("imported", 0, imported)
    callbacks = [build_callback(timeline, args.on_sigterm)]
    if args.upload_to:
        callbacks.append(build_uploader(args.upload_to))
    trainer = Trainer(model=model, args=training, train_dataset=dataset, callbacks=callbacks)
    resume = args.resume and any(args.output_dir.glob("checkpoint-*"))
    trainer.train(resume_from_checkpoint=True if resume else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

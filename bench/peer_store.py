"""What a user without jitckpt does with S3: HF checkpoints moved with `s5cmd`.

A checkpoint directory is uploaded with `s5cmd cp`, then an empty
``COMPLETE`` object is put beside it: s5cmd uploads a directory's files in
parallel, so a pod stopped half-way leaves a prefix that looks like a
checkpoint but is not one, and a careful user marks the end. Restoring lists
the prefix, takes the newest checkpoint with its marker and downloads it with
`s5cmd cp`, for `Trainer.train(resume_from_checkpoint=True)` to find in the
output directory.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from bench.procs import s5cmd_binary
from bench.transfer import run_s5cmd
from shim import layout

MARKER = "COMPLETE"


def upload(checkpoint: Path, root: str, env: dict[str, str]) -> float:
    """``checkpoint`` (a local ``checkpoint-<step>`` directory) to ``root``/<its name>/,
    its marker last; returns the seconds the files' `s5cmd cp` took."""
    seconds = run_s5cmd(["cp", f"{checkpoint}/*", f"{root}/{checkpoint.name}/"], env).seconds
    with tempfile.TemporaryDirectory(prefix="bench-marker-") as tmp:
        marker = Path(tmp) / MARKER
        marker.touch()
        run_s5cmd(["cp", str(marker), f"{root}/{checkpoint.name}/{MARKER}"], env)
    return seconds


def newest_complete(root: str, env: dict[str, str]) -> int | None:
    """The highest step under ``root`` whose marker is there (`s5cmd ls`), None if none."""
    argv = [s5cmd_binary(), "--endpoint-url", env["AWS_S3_ENDPOINT"], "ls", f"{root}/*"]
    listed = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if listed.returncode != 0:
        if "no object found" in listed.stderr:
            return None
        raise RuntimeError(f"s5cmd ls {root} exited {listed.returncode}: {listed.stderr}")
    steps = []
    for line in listed.stdout.splitlines():
        key = line.split()[-1] if line.split() else ""
        head, _, name = key.rpartition("/")
        step = layout.step_of(head.rsplit("/", 1)[-1])
        if name == MARKER and step is not None:
            steps.append(step)
    return max(steps, default=None)


def download(root: str, step: int, output_dir: Path, env: dict[str, str]) -> float:
    """``checkpoint-<step>`` from ``root`` into ``output_dir``; the seconds `s5cmd cp` took."""
    name = f"{layout.CHECKPOINT_PREFIX}{step}"
    target = output_dir / name
    target.mkdir(parents=True, exist_ok=True)
    return run_s5cmd(["cp", f"{root}/{name}/*", f"{target}/"], env).seconds

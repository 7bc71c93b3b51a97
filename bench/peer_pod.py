"""The peers' trainer container: what a user without jitckpt puts in front of the script.

The container's command, as a user would write it in the pod: find the
newest complete checkpoint (`s5cmd ls`), download it with `s5cmd cp` into
the output directory, then start the training script, which calls
``resume_from_checkpoint``. It stays in front of the script as PID 1 does
in the image's entrypoint: SIGTERM goes on to the script, and with
``--upload-at-exit`` (HF's ``enable_jit_checkpoint``) the checkpoint the
script saved at SIGTERM is uploaded with `s5cmd cp` once it has exited,
inside the pod's grace period. It exits with the script's code.

What the benchmark needs from it goes to ``--times`` (JSON): the seconds the
download took and when the script started (``time.monotonic()``, the clock
of the script's timeline).

    python -m bench.peer_pod --root s3://b/p --output-dir D --times F [--upload-at-exit] -- ARGV
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from bench import peer_store


def _newest_saved(output_dir: Path) -> Path | None:
    saved = sorted(output_dir.glob("checkpoint-*"), key=lambda p: p.stat().st_mtime)
    return saved[-1] if saved else None


def main() -> int:
    arguments = argparse.ArgumentParser(description=__doc__)
    arguments.add_argument("--root", required=True, help="where the job's checkpoints are")
    arguments.add_argument("--output-dir", type=Path, required=True)
    arguments.add_argument("--times", type=Path, required=True)
    arguments.add_argument("--upload-at-exit", action="store_true")
    arguments.add_argument("argv", nargs=argparse.REMAINDER)
    args = arguments.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    env = dict(os.environ)
    download = None
    step = peer_store.newest_complete(args.root, env)
    if step is not None:
        download = peer_store.download(args.root, step, args.output_dir, env)
    times = {"download_seconds": download, "trainer_started": time.monotonic()}
    args.times.write_text(json.dumps(times))
    script = subprocess.Popen(argv)
    terminated = False

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal terminated
        terminated = True
        script.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    code = script.wait()
    if terminated and args.upload_at_exit:
        saved = _newest_saved(args.output_dir)
        if saved is not None:
            peer_store.upload(saved, args.root, env)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())

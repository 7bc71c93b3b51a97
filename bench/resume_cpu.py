"""Where the CPU goes while a resumed pod's trainer starts (a diagnostic, not in `make bench`).

`bench.time_to_resume` measures a new pod's start to its first step. Its
trainer part (the container's start to the first step) varies by a second or
more between samples on this machine, and jitckpt's was the slower in some
runs. This says whose work fills that window: a sampler reads every
process's CPU time from ``/proc`` every 100 ms while the same resumed pods
run (``time_to_resume.resumed``), and each resumed attempt is reported as the
CPU seconds each command used between its trainer's start and its first
step. A sidecar still restoring, uploading or busy with the trainer, or the
S3 server serving it, shows up there beside the trainer's own work.

    python -m bench.resume_cpu [--mb 500] [--reps 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
SAMPLE_SECONDS = 0.1
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcessCpu:
    """One process's CPU seconds so far (``/proc/PID/stat``'s utime and stime)."""

    user: float
    system: float


def read_cpu(pid: int) -> ProcessCpu | None:
    """The process's CPU so far; None when it is gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command, which may hold spaces
    return ProcessCpu(int(fields[11]) / TICKS, int(fields[12]) / TICKS)


def command_of(pid: int) -> str:
    """A short name for the process: its program and its script or module."""
    try:
        argv = [
            a.decode(errors="replace")
            for a in (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
            if a
        ]
    except OSError:
        return "?"
    if not argv:
        return "?"
    program = os.path.basename(argv[0])
    script = next((a for a in argv[1:] if not a.startswith("-")), "")
    return f"{program} {os.path.basename(script)}".strip()


@dataclass
class CpuSampler:
    """Every process's CPU time, sampled until stopped; answers per window."""

    period: float = SAMPLE_SECONDS
    samples: list[tuple[float, dict[int, ProcessCpu]]] = field(default_factory=list)
    commands: dict[int, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        now = time.monotonic()
        found: dict[int, ProcessCpu] = {}
        for entry in PROC.iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            cpu = read_cpu(pid)
            if cpu is None:
                continue
            if pid not in self.commands:
                self.commands[pid] = command_of(pid)
            found[pid] = cpu
        self.samples.append((now, found))

    @contextmanager
    def running(self) -> Iterator[CpuSampler]:
        def loop() -> None:
            while not self._stop.is_set():
                self.sample()
                self._stop.wait(self.period)

        thread = threading.Thread(target=loop, name="cpu-sampler", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()

    def _nearest(self, at: float) -> int:
        """The index of the sample taken closest to ``at``."""
        return min(range(len(self.samples)), key=lambda i: abs(self.samples[i][0] - at))

    def between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds (user + system) each command used from ``start`` to ``end``
        (``time.monotonic()``), to the sampling period: a process born in the window
        counts from zero, one that ended in it up to its last sample."""
        first, last = self._nearest(start), self._nearest(end)
        before = self.samples[first][1]
        after: dict[int, ProcessCpu] = {}
        for _, found in self.samples[first : last + 1]:
            after.update(found)
        used: defaultdict[str, float] = defaultdict(float)
        for pid, cpu in after.items():
            base = before.get(pid, ProcessCpu(0.0, 0.0))
            used[self.commands.get(pid, "?")] += cpu.user + cpu.system - base.user - base.system
        return dict(used)


def main() -> int:
    from bench.goodput import BUCKET, HF_JIT, JITCKPT
    from bench.time_to_resume import resumed
    from bench.training_run import ModelShape
    from local.s3server import LocalS3

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=500, help="model + optimizer state, MB")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    shape = ModelShape.for_state(f"{args.mb} MB", args.mb * 1_000_000)
    with LocalS3() as s3, CpuSampler().running() as sampler:
        for rep in range(args.reps):
            for subject in (JITCKPT, HF_JIT) if rep % 2 == 0 else (HF_JIT, JITCKPT):
                s3.reset()
                s3.create_bucket(BUCKET)
                attempt = resumed(subject, shape, s3.credentials_env())
                trainer_started = attempt.started_at + attempt.restore_seconds
                first_step = attempt.started_at + attempt.first_step_seconds
                print(
                    f"{subject}, {args.mb} MB, rep {rep}: the trainer's start to its first "
                    f"step {first_step - trainer_started:.2f} s; CPU seconds meanwhile:"
                )
                used = sampler.between(trainer_started, first_step)
                for command, seconds in sorted(used.items(), key=lambda item: -item[1])[:6]:
                    if seconds >= 0.05:
                        print(f"  {seconds:6.2f}  {command}")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

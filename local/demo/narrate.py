"""The demo's running account: short timestamped lines a person can follow.

It turns pod events (from the runner) and sidecar status documents into
sentences, saying each thing once: a sidecar ready (and what it restored),
training progress every few steps, the preStop hook and SIGTERM, each
checkpoint the sidecars committed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

from local.podrunner import PodEvent

PROGRESS_EVERY = 5  # steps between progress lines


def downloaded(size: object) -> str:
    """What a restore fetched from the store, as the sidecar's status says it."""
    if not isinstance(size, int):
        return "bytes downloaded unknown"
    if size == 0:
        return "the copy on the pod's volume, nothing downloaded"
    return f"{size / 1e6:.2f} MB downloaded"


@dataclass
class Narrator:
    stream: IO[str]
    started: float = field(default_factory=time.monotonic)
    _said: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _last_step: int = -1

    def say(self, text: str) -> None:
        with self._lock:
            elapsed = time.monotonic() - self.started
            self.stream.write(f"[{elapsed:6.1f}s] {text}\n")
            self.stream.flush()

    def once(self, key: str, text: str) -> None:
        with self._lock:
            if key in self._said:
                return
            self._said.add(key)
        self.say(text)

    def new_run(self) -> None:
        """New pods (possibly with the same names): say everything afresh."""
        with self._lock:
            self._last_step = -1
            self._said.clear()

    def pod_event(self, event: PodEvent) -> None:
        where = f"{event.pod}/{event.container}" if event.container else event.pod
        if event.reason == "Started" and event.message.startswith("startupProbe passed"):
            self.say(f"{where}: {event.message} (the trainer may start)")
        elif event.reason == "PreStopHook":
            self.say(f"{where}: preStop hook {event.message.split(':')[0]}")
        elif event.reason == "Killing" and "SIGKILL" in event.message:
            self.say(f"{where}: {event.message}")
        elif event.reason == "Failed":
            self.say(f"pod failed: {event.message}")

    def status(self, pod: str, doc: dict[str, Any]) -> None:
        restored = doc.get("restored")
        if doc.get("phase") not in (None, "starting", "restoring"):
            if restored:
                self.once(
                    f"{pod}/restored",
                    f"{pod}: sidecar restored checkpoint-{restored.get('step')} "
                    f"({downloaded(restored.get('downloaded'))})",
                )
            elif doc.get("restoring") is not None:
                self.once(
                    f"{pod}/restoring",
                    f"{pod}: sidecar restoring checkpoint-{doc.get('restoring')}; the trainer "
                    "starts meanwhile and waits for it where the checkpoint is read",
                )
            else:
                self.once(f"{pod}/restored", f"{pod}: sidecar ready, nothing to restore")
        progress = doc.get("progress") or {}
        step = progress.get("step")
        if isinstance(step, int) and step >= self._last_step + PROGRESS_EVERY:
            self._last_step = step
            self.say(f"training: step {step}/{progress.get('max_steps', '?')}")
        last = doc.get("last_committed")
        if last:
            self.once(
                f"{pod}/committed/{last.get('step')}",
                f"{pod}: committed checkpoint-{last.get('step')} ({last.get('kind')}, "
                f"{int(last.get('size', 0)) / 1e6:.1f} MB, upload {last.get('seconds', 0):.2f} s)",
            )

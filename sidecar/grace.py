"""The grace-period clock and the "is the grace period long enough?" estimate.

The deadline runs from the sidecar's own SIGTERM only. The shim's ``sigterm``
message comes over a socket any process of the trainer container can write:
one sent early (or forged) must not move the moment the sidecar stops
waiting for a checkpoint staged later, so it only marks when the trainer's
save began, for the estimate. The estimate uses what this pod measured: how
long the JIT save took (the trainer's SIGTERM, else the sidecar's, to
``staged``) and how fast uploads went, applied to the size of the newest
checkpoint.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass
class GraceClock:
    grace_seconds: float
    margin: float
    sigterm_at: float | None = None  # monotonic, the sidecar's own SIGTERM
    trainer_sigterm_at: float | None = None  # monotonic, as the trainer said (estimate only)
    save_seconds: float | None = None  # SIGTERM -> JIT staged, measured
    upload_bytes_per_second: float | None = None
    last_checkpoint_bytes: int = 0
    jit_upload_seconds: float | None = None  # measured, once the JIT one is committed

    def start(self, now: float | None = None) -> None:
        if self.sigterm_at is None:
            self.sigterm_at = time.monotonic() if now is None else now

    def trainer_said(self, now: float | None = None) -> None:
        """The trainer says it got SIGTERM: its save starts now (the deadline does not)."""
        if self.trainer_sigterm_at is None:
            self.trainer_sigterm_at = time.monotonic() if now is None else now

    @property
    def started(self) -> bool:
        return self.sigterm_at is not None

    def remaining(self, now: float | None = None) -> float | None:
        """Seconds until the point where the sidecar must stop working, or None before SIGTERM."""
        if self.sigterm_at is None:
            return None
        current = time.monotonic() if now is None else now
        return self.sigterm_at + self.grace_seconds - self.margin - current

    def saved(self, now: float | None = None) -> None:
        """A JIT checkpoint was staged: the save took this long."""
        began = self.trainer_sigterm_at if self.trainer_sigterm_at is not None else self.sigterm_at
        if began is not None and self.save_seconds is None:
            current = time.monotonic() if now is None else now
            self.save_seconds = max(0.0, current - began)

    def uploaded(self, size: int, seconds: float, jit: bool) -> None:
        if seconds > 0 and size > 0:
            self.upload_bytes_per_second = size / seconds
        self.last_checkpoint_bytes = size
        if jit:
            self.jit_upload_seconds = seconds

    def upload_estimate(self) -> float | None:
        """Seconds the newest checkpoint takes to upload: measured for the JIT one, else from
        the last upload's throughput; None before any upload."""
        if self.jit_upload_seconds is not None:
            return self.jit_upload_seconds
        if self.upload_bytes_per_second and self.last_checkpoint_bytes:
            return self.last_checkpoint_bytes / self.upload_bytes_per_second
        return None

    def needed(self) -> float | None:
        """Estimated SIGTERM-to-committed seconds, or None before anything was measured."""
        upload = self.upload_estimate()
        if upload is None and self.save_seconds is None:
            return None
        return (self.save_seconds or 0.0) + (upload or 0.0)

    def short_by(self) -> float | None:
        """How many seconds the grace period lacks (positive), or None when it is enough."""
        needed = self.needed()
        if needed is None:
            return None
        lack = needed + self.margin - self.grace_seconds
        return lack if lack > 0 else None

    def report(self) -> dict[str, object]:
        needed = self.needed()
        short = self.short_by()
        doc: dict[str, object] = {
            "grace_seconds": self.grace_seconds,
            "margin_seconds": self.margin,
            "save_seconds": _round(self.save_seconds),
            "upload_seconds": _round(self.upload_estimate()),
            "needed_seconds": _round(needed),
            "short_by_seconds": _round(short),
            "message": self.message(),
        }
        return doc

    def message(self) -> str:
        short = self.short_by()
        if short is None:
            return ""
        save = "not measured" if self.save_seconds is None else f"{self.save_seconds:.1f} s"
        upload = self.upload_estimate()
        uploaded = "not measured yet" if upload is None else f"{upload:.1f} s"
        return (
            f"grace period {self.grace_seconds:g} s is too short for the measured checkpoint "
            f"(save {save} + upload {uploaded} + margin {self.margin:g} s): raise "
            f"jitckpt.io/grace-period-seconds by at least {math.ceil(short)} s"
        )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)

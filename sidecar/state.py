"""What the sidecar knows of itself: source of `/status`, metrics and the termination message."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Literal

from sidecar.config import AgentConfig
from sidecar.grace import GraceClock

# Drops remembered for ``/status`` (the count keeps growing; the list keeps the newest).
MAX_SUPERSEDED = 32

# "unprotected": the store cannot be reached; the trainer runs without checkpoints.
AgentPhase = Literal[
    "starting", "restoring", "ready", "stopping", "stopped", "failed", "unprotected"
]


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Committed:
    step: int
    kind: str
    uri: str
    time: str
    size: int
    seconds: float


@dataclass
class ClientInfo:
    pid: int
    rank: int | None = None
    node_rank: int | None = None
    framework: str = ""
    said_bye: bool = False
    exit_code: int | None = None
    unfollowed: str | None = None  # why this process gets no JIT checkpoint (it said so)


@dataclass
class AgentState:
    config: AgentConfig
    grace: GraceClock
    phase: AgentPhase = "starting"
    restored: dict[str, object] | None = None
    restoring: int | None = None  # the step being fetched while the trainer may run
    downloaded_bytes: int = 0  # fetched from the store by this pod's restores, all of them
    restore_skipped: list[dict[str, object]] = field(default_factory=list)
    last_committed: Committed | None = None
    committed: list[Committed] = field(default_factory=list)
    final: Committed | None = None  # the final model this pod committed to final/
    progress: dict[str, object] | None = None
    clients: dict[int, ClientInfo] = field(default_factory=dict)
    last_error: str | None = None
    identity: dict[str, str] | None = None  # where the store's credentials come from
    # Why a training process of this pod gets no JIT checkpoint, as the first to say it did.
    unfollowed: str | None = None
    # Why the trainer runs unprotected (the store cannot be reached), or None.
    unprotected: str | None = None
    # The restored checkpoint, set aside because resumes from it failed: step and reason.
    set_aside: dict[str, object] | None = None
    # Staged checkpoints dropped unuploaded because a newer one superseded them (newest last).
    superseded: deque[dict[str, object]] = field(
        default_factory=lambda: deque(maxlen=MAX_SUPERSEDED)
    )
    superseded_count: int = 0
    queue_view: Callable[[], list[dict[str, object]]] = field(default=lambda: [])

    def dropped(self, step: int, kind: str, why: str) -> None:
        """Say in ``/status`` that checkpoint-``step`` will not be uploaded, and why."""
        self.superseded.append({"step": step, "kind": kind, "reason": why, "time": now_iso()})
        self.superseded_count += 1

    def document(self) -> dict[str, object]:
        """The ``/status`` and ``status``-op document."""
        cfg = self.config
        remaining = self.grace.remaining()
        return {
            "phase": self.phase,
            "mode": cfg.mode,
            "destination": cfg.destination,
            "job": cfg.job_name,
            "pod": cfg.pod_name,
            "node_rank": cfg.node_rank,
            "nnodes": cfg.nnodes,
            "identity": self.identity,
            "unprotected": self.unprotected,
            "restored": self.restored,
            "restoring": self.restoring,
            "downloaded_bytes": self.downloaded_bytes,
            "restore_skipped": self.restore_skipped,
            "set_aside": self.set_aside,
            "unfollowed": self.unfollowed,
            "last_committed": asdict(self.last_committed) if self.last_committed else None,
            "committed_count": len(self.committed),
            "final": asdict(self.final) if self.final else None,
            "queue": self.queue_view(),
            "superseded": list(self.superseded),
            "superseded_count": self.superseded_count,
            "progress": self.progress,
            "clients": [asdict(c) for c in self.clients.values()],
            "sigterm": self.grace.started,  # the sidecar's own: its deadline runs
            "trainer_sigterm": self.grace.trainer_sigterm_at is not None,  # as the trainer said
            "seconds_to_deadline": None if remaining is None else round(remaining, 1),
            "grace": self.grace.report(),
            "last_error": self.last_error,
        }

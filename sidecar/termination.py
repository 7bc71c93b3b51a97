"""The container's termination message: what ``kubectl describe pod`` shows, no RBAC needed.

One short JSON object (the kubelet keeps at most 4096 bytes): the last
committed checkpoint, the final model when this pod committed one, what was
left uncommitted, the last step the trainer reported, why a training process
gets no JIT checkpoint when one said so, and the grace-period report when the
grace period is too short for the measured checkpoint.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from sidecar.state import AgentState

LIMIT = 4096

log = logging.getLogger(__name__)


def message(state: AgentState, uncommitted: list[dict[str, object]], note: str = "") -> str:
    last = state.last_committed
    if state.unprotected is not None:
        summary = f"UNPROTECTED: {state.unprotected}"
        return json.dumps({"message": summary[: LIMIT - 64], "unprotected": True})
    summary = (
        f"last committed checkpoint: step {last.step} ({last.kind}) at {last.uri}"
        if last
        else "no checkpoint committed by this pod"
    )
    if state.final:
        summary += f"; final model: {state.final.size} bytes at {state.final.uri}"
    if uncommitted:
        steps = ", ".join(f"{u['step']} ({u['kind']})" for u in uncommitted)
        summary += f"; NOT committed: {steps}"
    grace = state.grace.message()
    if grace:
        summary += f"; {grace}"
    if state.set_aside:
        summary += f"; checkpoint-{state.set_aside['step']} set aside: {state.set_aside['reason']}"
    if state.unfollowed:
        summary += f"; a training process gets no JIT checkpoint: {state.unfollowed}"
    if note:
        summary += f"; {note}"
    doc: dict[str, object] = {
        "message": summary,
        "last_committed": (
            {"step": last.step, "kind": last.kind, "uri": last.uri, "time": last.time}
            if last
            else None
        ),
        "final": (
            {"uri": state.final.uri, "size": state.final.size, "time": state.final.time}
            if state.final
            else None
        ),
        "restored_step": (state.restored or {}).get("step"),
        # Bytes this pod's restores fetched from the store (0: none, or the local copy used).
        "downloaded_bytes": state.downloaded_bytes,
        "set_aside": state.set_aside,
        "unfollowed": state.unfollowed,
        # The trainer's final progress report: the step its run ended at.
        "last_step": (state.progress or {}).get("step"),
        "uncommitted": uncommitted,
        # Dropped unuploaded: a newer checkpoint superseded them (``/status`` says why).
        "superseded": [item["step"] for item in state.superseded],
        "grace_short_by_seconds": state.grace.report()["short_by_seconds"],
    }
    text = json.dumps(doc, separators=(",", ":"))
    if len(text.encode()) > LIMIT:
        text = json.dumps({"message": summary[: LIMIT - 32]})
    return text


def write(path: Path, text: str) -> None:
    """Best effort: a missing terminationMessagePath must not crash the shutdown."""
    try:
        path.write_text(text)
    except OSError as exc:
        log.warning("cannot write the termination message to %s: %s", path, exc)

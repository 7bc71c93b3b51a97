"""The shim's settings, read once from the environment the webhook wrote.

Parsing is forgiving: a malformed value is reported once and treated as unset,
because a typo in an annotation must not stop a training run. ``ShimConfig`` is
a plain class rather than a dataclass on purpose: importing ``dataclasses``
(and ``inspect`` behind it) costs about 10 ms in every Python process of the
container, the shim's budget is close to nothing.
"""

from __future__ import annotations

import os

from . import layout
from .log import say_once

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Mapping, Optional, TypeVar

    T = TypeVar("T")

_FALSE = ("false", "0", "no", "off")


def _parsed(env: Mapping[str, str], name: str, kind: Callable[[str], T], what: str) -> Optional[T]:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return kind(raw)
    except ValueError:
        say_once("env:" + name, "ignoring %s=%r: not %s" % (name, raw, what))
        return None


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    return _parsed(env, name, int, "an integer")


def _number(env: Mapping[str, str], name: str) -> Optional[float]:
    return _parsed(env, name, float, "a number")


class ShimConfig:
    """What the webhook asked for, as the shim understands it (read-only by convention)."""

    __slots__ = (
        "demo_final_weights",
        "demo_hold_at_step",
        "grace_seconds",
        "jit",
        "local_dir",
        "save_steps",
        "save_strategy",
        "save_total_limit",
        "socket_path",
        "upload_final",
    )

    def __init__(
        self,
        *,
        local_dir: str,
        socket_path: str,
        grace_seconds: Optional[int] = None,
        jit: bool = True,
        save_strategy: Optional[str] = None,
        save_steps: Optional[float] = None,
        save_total_limit: Optional[int] = None,
        upload_final: bool = True,
        demo_hold_at_step: Optional[int] = None,
        demo_final_weights: Optional[str] = None,
    ) -> None:
        self.local_dir = local_dir
        self.socket_path = socket_path
        self.grace_seconds = grace_seconds
        self.jit = jit
        self.save_strategy = save_strategy
        self.save_steps = save_steps
        self.save_total_limit = save_total_limit
        self.upload_final = upload_final
        # Set only in the pods ``jitckpt demo`` generates (see trainrun): hold at this step
        # until the SIGTERM comes; write the trained weights to this file at the end.
        self.demo_hold_at_step = demo_hold_at_step
        self.demo_final_weights = demo_final_weights

    @property
    def checkpoints_dir(self) -> str:
        return os.path.join(self.local_dir, layout.CHECKPOINTS_SUBDIR)

    @property
    def staging_dir(self) -> str:
        return os.path.join(self.local_dir, layout.STAGING_SUBDIR)

    @property
    def pids_dir(self) -> str:
        """Next to the socket: both live on the pod's in-memory run volume."""
        return os.path.join(os.path.dirname(self.socket_path), layout.PIDS_SUBDIR)

    def shutdown_timeout(self) -> Optional[int]:
        """Seconds torchrun should wait for its workers, or None without a grace period."""
        if self.grace_seconds is None:
            return None
        return layout.shutdown_timeout(self.grace_seconds)


def from_env(env: Optional[Mapping[str, str]] = None) -> Optional[ShimConfig]:
    """The configuration, or None when the shim must stay inactive (no ``JITCKPT_DIR``)."""
    source: Mapping[str, str] = os.environ if env is None else env
    local_dir = source.get(layout.ENV_DIR, "").strip()
    if not local_dir:
        return None
    return ShimConfig(
        local_dir=local_dir,
        socket_path=source.get(layout.ENV_SOCKET, "").strip() or layout.SOCKET_PATH,
        grace_seconds=_int(source, layout.ENV_GRACE_SECONDS),
        jit=source.get(layout.ENV_JIT, "true").strip().lower() not in _FALSE,
        save_strategy=source.get(layout.ENV_SAVE_STRATEGY, "").strip().lower() or None,
        save_steps=_number(source, layout.ENV_SAVE_STEPS),
        save_total_limit=_int(source, layout.ENV_SAVE_TOTAL_LIMIT),
        upload_final=source.get(layout.ENV_UPLOAD_FINAL, "true").strip().lower() not in _FALSE,
        demo_hold_at_step=_int(source, layout.ENV_DEMO_HOLD_AT_STEP),
        demo_final_weights=source.get(layout.ENV_DEMO_FINAL_WEIGHTS, "").strip() or None,
    )

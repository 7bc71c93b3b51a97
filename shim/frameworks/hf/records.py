"""A rank's record of the shim's own, saved beside HF's files in a checkpoint.

The data replay (``data``) and a subclass's own state (``hidden``) each keep
one file per rank in every checkpoint HF writes. It comes back from the store,
so it is read as data only (``torch.load(weights_only=True)``), and a torn or
foreign one is said and left alone: the resume goes on as HF's own would.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

from ... import dist
from ...log import failed, say


def path(directory: str, name: str) -> str:
    """This rank's record ``name`` (a ``%d`` pattern) in ``directory``."""
    return os.path.join(directory, name % dist.ranks()["rank"])


def read(checkpoint: Any, name: str, version: int, otherwise: str) -> Optional[Dict[str, Any]]:
    """This rank's record in ``checkpoint`` at ``version``, or None (none, torn, foreign:
    ``otherwise`` says what happens instead)."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        return None
    where = path(os.fspath(checkpoint), name)
    if not os.path.isfile(where):
        return None
    import torch

    try:
        payload = torch.load(where, weights_only=True)
    except Exception as exc:
        say("cannot read %s (%s: %s): %s" % (where, type(exc).__name__, exc, otherwise))
        return None
    if isinstance(payload, dict) and payload.get("version") == version:
        return payload
    return None


def on_rng_save(module: Any, write: Callable[[Any, str], None], what: str) -> bool:
    """Call ``write(trainer, directory)`` each time HF saves a rank's random states into a
    checkpoint (``_save_rng_state``: every rank, every checkpoint); False when this
    transformers has no such method. ``what`` names the record in a failure's line."""
    import functools

    trainer_cls = module.Trainer
    save_rng = getattr(trainer_cls, "_save_rng_state", None)
    if save_rng is None:
        return False

    @functools.wraps(save_rng)
    def _save_rng_state(self: Any, output_dir: Any, *args: Any, **kwargs: Any) -> Any:
        result = save_rng(self, output_dir, *args, **kwargs)
        try:
            write(self, os.fspath(output_dir))
        except Exception as exc:
            failed("saving %s" % what, exc)
        return result

    trainer_cls._save_rng_state = _save_rng_state
    return True

"""Finding ``checkpoint-<step>`` directories in a local directory."""

from __future__ import annotations

import os
from typing import List, Optional, Tuple, Union

from .layout import step_of


def list_checkpoints(directory: str) -> List[Tuple[int, str]]:
    """``(step, path)`` of every checkpoint directory, oldest first; [] when missing."""
    found: List[Tuple[int, str]] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return found
    for entry in entries:
        step = step_of(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, entry.path))
    found.sort()
    return found


def newest_checkpoint(
    directory: str, marker: Union[str, Tuple[str, ...]], excluded: Optional[int] = None
) -> Optional[Tuple[int, str]]:
    """The newest checkpoint a framework finished writing: its ``marker`` file is there.

    Each framework writes one file last (HF its ``trainer_state.json``); a
    directory without it was cut short and is never resumed from. Where no
    single file is written last in every save (a sharded save written in the
    background), ``marker`` names several, all of which must be there.
    ``excluded``: the step of a checkpoint the sidecar set aside, never resumed
    from.
    """
    markers = (marker,) if isinstance(marker, str) else marker
    for step, path in reversed(list_checkpoints(directory)):
        if step != excluded and all(os.path.isfile(os.path.join(path, m)) for m in markers):
            return step, path
    return None

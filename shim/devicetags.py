"""A host copy of a GPU storage is saved as the GPU storage was.

``torch.save`` records each storage's device in the file, and a plain
``torch.load`` puts it back there. A background save writes host copies of a
GPU's storages (in the training process's writer thread, or in the writer
process), so the file would say ``cpu`` where the synchronous save said
``cuda:0``: the checkpoint would not be the one the framework writes, and a
user's own ``torch.load`` of it would land on another device. A location tagger
(torch.serialization's ``register_package``), consulted before torch's own, names
the original device of each registered copy, by its address, for as long as the
copy is registered.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

# Host copies of GPU storages while a snapshot holds them: address -> the device they were
# copied from.
_COPIED_FROM: Dict[int, str] = {}
_TAGGER: List[bool] = []


def _copied_from(storage: Any) -> Optional[str]:
    """torch.serialization's location tagger: the original device of a snapshot's copy."""
    if not _COPIED_FROM:
        return None
    try:
        device = _COPIED_FROM.get(storage.data_ptr())
    except Exception:
        return None
    if device is None:
        return None
    # A new string each time, as torch's own GPU tagger makes ("cuda:" + index): pickle
    # writes it out again for each storage rather than referring back to the first (the
    # same bytes). Formatting a string can hand back the same object; concatenation not.
    kind, _, index = device.partition(":")
    return kind + ":" + index if index else device


def _not_ours(storage: Any, location: str) -> None:
    """The loading side of the tagger: torch's own deserializers serve these devices."""
    return None


def register(copied: Any, device: Any) -> None:
    """Save ``copied`` (a host storage) as if it were on ``device`` until ``forget``."""
    if not _TAGGER:
        _TAGGER.append(True)
        from torch.serialization import register_package

        register_package(1, _copied_from, _not_ours)  # before torch's cpu tagger (10)
    if copied.nbytes() > 0:
        _COPIED_FROM[copied.data_ptr()] = str(device)


def forget(copied: Any) -> None:
    """The copy is written (its memory goes, its address may be reused)."""
    if copied.nbytes() > 0:
        _COPIED_FROM.pop(copied.data_ptr(), None)


def registered() -> int:
    """How many copies are registered now (none once every snapshot is released)."""
    return len(_COPIED_FROM)

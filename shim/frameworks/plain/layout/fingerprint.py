"""Whether a state changed since it was last looked at, without keeping a copy of it.

A fingerprint of a state (a ``state_dict``: tensors among lists, dicts and
plain values) is the layout of its plain values, each tensor's place and
version counter (``data_ptr``, ``_version``, shape, dtype), and two sums of
each tensor's bytes (its 32-bit words, and every third one), computed where
the tensor lives and read back in one transfer per device.

The version counter moves with every in-place operation that autograd
sees (an optimizer's step, ``copy_``, ``lerp_``), so a changed counter
settles it without reading a byte. It does not move for writes through
``.data`` or for BatchNorm's running statistics, so an unchanged counter is
confirmed by the sums: a state nobody changed is read once at the baseline
and once when checked, never at every step.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

Layout = Tuple[Any, ...]


class Fingerprint:
    """What is remembered of one state."""

    def __init__(self, layout: Layout, places: List[Tuple[Any, ...]], sums: List[Any]) -> None:
        self.layout = layout
        self.places = places
        self.sums = sums


def _split(state: Any, tensors: List[Any]) -> Any:
    """The state's structure with each tensor replaced by its index in ``tensors``."""
    import torch

    if isinstance(state, torch.Tensor):
        tensors.append(state)
        return ("<tensor>", len(tensors) - 1)
    if isinstance(state, dict):
        return tuple((repr(key), _split(value, tensors)) for key, value in state.items())
    if isinstance(state, (list, tuple)):
        return (type(state).__name__, *(_split(value, tensors) for value in state))
    return repr(state)


def _place(tensor: Any) -> Tuple[Any, ...]:
    try:
        return (tensor.data_ptr(), tensor._version, tuple(tensor.shape), str(tensor.dtype))
    except Exception:  # a tensor without storage: no place to compare
        return (None, None, tuple(tensor.shape), str(tensor.dtype))


def _sums(tensors: List[Any]) -> List[Any]:
    """Two sums of each tensor's bytes (None where they cannot be taken)."""
    import torch

    partial: List[Any] = []
    for tensor in tensors:
        try:
            flat = tensor.detach().reshape(-1)
            if not flat.is_contiguous():
                flat = flat.contiguous()
            raw = flat.view(torch.uint8)
            words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
            partial.append(
                torch.stack(
                    [words.sum(dtype=torch.int64), words[::3].sum(dtype=torch.int64)]
                ).reshape(2)
            )
        except Exception:  # sparse, quantized, meta: unknown, so never "unchanged"
            partial.append(None)
    by_device: Dict[Any, List[int]] = {}
    for index, value in enumerate(partial):
        if value is not None:
            by_device.setdefault(value.device, []).append(index)
    found: List[Any] = [None] * len(tensors)
    for indices in by_device.values():
        values = torch.stack([partial[i] for i in indices]).cpu().tolist()
        for index, pair in zip(indices, values):
            found[index] = tuple(pair)
    return found


def take(state: Any) -> Fingerprint:
    tensors: List[Any] = []
    layout = _split(state, tensors)
    return Fingerprint(layout, [_place(t) for t in tensors], _sums(tensors))


def changed(before: Optional[Fingerprint], state: Any, by_place: bool) -> bool:
    """Whether ``state`` differs from what ``before`` remembers.

    ``by_place``: a moved version counter or storage means changed (a module's
    tensors, which ``state_dict`` returns as views); otherwise only the
    contents count (an object's ``state_dict`` may build new tensors each call).
    """
    if before is None:
        return True
    tensors: List[Any] = []
    if _split(state, tensors) != before.layout:
        return True
    if by_place and [_place(t) for t in tensors] != before.places:
        return True
    sums = _sums(tensors)
    return any(value is None for value in sums) or sums != before.sums

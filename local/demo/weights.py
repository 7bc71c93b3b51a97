"""What two runs produced, compared tensor by tensor, bit for bit.

``torch.equal`` calls ``-0.0`` equal to ``0.0`` and NaN unequal to itself;
resuming must reproduce the very bytes, so the bytes are compared. Two kinds
of input: the shim's final weights (``compare_files``: two state dicts), and
any file a script saved at its end (``compare_saved``): what ``torch.save``
wrote is loaded and compared tensor by tensor and value by value (the zip
archive's own bytes may differ where the contents do not), a ``.safetensors``
file tensor by tensor, and any other file byte for byte.
"""

from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WHOLE_FILE = ""  # the name of a difference that is the file itself


@dataclass(frozen=True)
class Comparison:
    tensors: int
    differing: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return self.tensors > 0 and not self.differing


def same_tensor(x: Any, y: Any) -> bool:
    """Same dtype, shape and bytes."""
    import torch

    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    xb = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    yb = y.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(xb, yb))


def compare_files(left: Path, right: Path) -> Comparison:
    """Compare two ``torch.save``d state dicts."""
    import torch

    a = torch.load(left, map_location="cpu", weights_only=True)
    b = torch.load(right, map_location="cpu", weights_only=True)
    differing = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        if not same_tensor(a[name], b[name]):
            differing.append(name)
    return Comparison(tensors=len(set(a) | set(b)), differing=differing)


def compare_saved(left: Path, right: Path) -> list[str]:
    """Where two files a script saved differ (``WHOLE_FILE``: the file as a whole); [] if equal."""
    a, b = _load(left), _load(right)
    if a is None or b is None:
        return [] if left.read_bytes() == right.read_bytes() else [WHOLE_FILE]
    found: list[str] = []
    _differences(a, b, "", found)
    return found


def _load(path: Path) -> Any:
    """The tensors and values a torch.save or safetensors file holds (None: compare the bytes)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception:
            return None
    if not zipfile.is_zipfile(path):
        return None
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # not torch.save's archive, or objects beyond tensors and plain values
        return None


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def _differences(a: Any, b: Any, where: str, found: list[str]) -> None:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        if not (both and same_tensor(a, b)):
            found.append(where)
    elif isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key in a and key in b:
                _differences(a[key], b[key], _join(where, key), found)
            else:
                found.append(_join(where, key))
    elif isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _differences(x, y, f"{where}[{index}]", found)
    elif not same_value(a, b):
        found.append(where)


def same_value(a: Any, b: Any) -> bool:
    """Same type and value; floats bit for bit (``-0.0`` is not ``0.0``, NaN is NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return bool(a == b)

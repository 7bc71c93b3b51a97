"""Final weights of two runs, compared tensor by tensor, bit for bit.

``torch.equal`` calls ``-0.0`` equal to ``0.0`` and NaN unequal to itself;
resuming must reproduce the very bytes, so the bytes are compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Comparison:
    tensors: int
    differing: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return self.tensors > 0 and not self.differing


def compare_files(left: Path, right: Path) -> Comparison:
    """Compare two ``torch.save``d state dicts."""
    import torch

    a = torch.load(left, map_location="cpu", weights_only=True)
    b = torch.load(right, map_location="cpu", weights_only=True)
    differing = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        same = x.dtype == y.dtype and x.shape == y.shape
        if same:
            xb = x.detach().contiguous().reshape(-1).view(torch.uint8)
            yb = y.detach().contiguous().reshape(-1).view(torch.uint8)
            same = torch.equal(xb, yb)
        if not same:
            differing.append(name)
    return Comparison(tensors=len(set(a) | set(b)), differing=differing)

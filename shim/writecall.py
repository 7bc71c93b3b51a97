"""Which file a framework's write call writes.

``torch.save(obj, f)``, safetensors' ``save_file(tensors, filename)`` and the
names frameworks give them take the destination second, or by keyword: the
background saver and the JIT stream both need to know it.
"""

from __future__ import annotations

from typing import Any, Mapping, Tuple


def target(args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The destination of a write call: a path, or a buffer or open file as given."""
    if len(args) > 1:
        return args[1]
    return kwargs.get("f", kwargs.get("filename"))

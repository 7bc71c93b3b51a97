"""Which file a framework's write call writes.

``torch.save(obj, f)``, safetensors' ``save_file(tensors, filename)`` and the
names frameworks give them take the destination second, or by keyword: the
background saver and the JIT stream both need to know it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Tuple

# Set on the shim's own wrappers of a write function, whose ``__wrapped__`` writes the same
# file and whose own work does not apply to a checkpoint written in the background (the
# final-model recorder, the capture's deferral): the writer process calls what they wrap.
PASSTHROUGH = "_jitckpt_passthrough"


def target(args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The destination of a write call: a path, or a buffer or open file as given."""
    if len(args) > 1:
        return args[1]
    return kwargs.get("f", kwargs.get("filename"))


def mark_passthrough(wrapper: Callable[..., Any], wrapped: Callable[..., Any]) -> None:
    """``wrapper`` (the shim's) writes what ``wrapped`` writes (``PASSTHROUGH``)."""
    wrapper.__wrapped__ = wrapped  # type: ignore[attr-defined]
    setattr(wrapper, PASSTHROUGH, True)


def unwrapped(function: Any) -> Any:
    """``function`` without the shim's passthrough wrappers."""
    while getattr(function, PASSTHROUGH, False):
        function = function.__wrapped__
    return function

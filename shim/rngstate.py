"""The random states a training process draws from, captured and put back exactly.

Python's ``random``, numpy's global generator (when the program imported
numpy), torch's CPU generator and every CUDA device's, and the
``torch.Generator`` objects a data loader and its samplers carry. Captured
states hold only tensors, lists and numbers, so a checkpoint loads with
``torch.load(weights_only=True)``: a checkpoint comes from the store and must
not be able to run code.
"""

from __future__ import annotations

import random
import sys
from typing import Any, Dict, List

# Attributes that lead from a data loader to its samplers and generators.
_LINKS = ("batch_sampler", "sampler", "generator", "synchronized_generator")
_DEPTH = 5


def capture() -> Dict[str, Any]:
    """The global random states of this process, now."""
    import torch

    version, internal, gauss = random.getstate()
    state: Dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, position, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": [int(key) for key in keys],
            "pos": int(position),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore(state: Dict[str, Any]) -> None:
    """Put back what ``capture`` returned (a generator absent now is left alone)."""
    import torch

    saved = state["python"]
    random.setstate((saved["version"], tuple(saved["state"]), saved["gauss"]))
    torch.set_rng_state(state["torch"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in state:
        saved = state["numpy"]
        keys = numpy.array(saved["keys"], dtype=numpy.uint32)
        numpy.random.set_state(
            (saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached"])
        )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def capture_with(generators: List[Any]) -> Dict[str, Any]:
    """The global states and those of ``generators`` (what a data loader draws from)."""
    return {"rng": capture(), "generators": [g.get_state() for g in generators]}


def restore_with(state: Dict[str, Any], generators: List[Any]) -> bool:
    """Put back what ``capture_with`` took. False, the generators left alone, when there
    are not as many of them as when it was taken."""
    restore(state["rng"])
    saved = state.get("generators", [])
    if len(saved) != len(generators):
        return False
    for generator, generator_state in zip(generators, saved):
        generator.set_state(generator_state)
    return True


def generators(*roots: Any) -> List[Any]:
    """The ``torch.Generator`` objects reachable from ``roots`` (through samplers), in order."""
    import torch

    found: List[Any] = []
    seen = set()

    def walk(obj: Any, depth: int) -> None:
        if obj is None or id(obj) in seen or depth > _DEPTH:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Generator):
            found.append(obj)
            return
        for name in _LINKS:
            walk(getattr(obj, "__dict__", {}).get(name), depth + 1)

    for root in roots:
        walk(root, 0)
    return found

"""Which Lightning Fabric setups a plain-loop checkpoint serves.

A Fabric loop is the program's own: ``fabric.setup`` wraps the module (a
``_FabricModule`` around DDP's), the optimizer (its ``step`` goes through the
strategy and the precision plugin to the real one) and the loader (Fabric's
``DistributedSampler`` over the program's dataset); the plain-loop capture
follows all of them. Fabric's strategies that keep the training state their
own way are not served: FSDP's flat parameters, ``ModelParallelStrategy``'s
meshes, DeepSpeed's engine (its optimizer step never reaches a torch
optimizer's). They are told once, and the loop gets no JIT checkpoint.
"""

from __future__ import annotations

from typing import Any, Optional

from ..plain.created import Created, note_instances

# Fabric's strategies whose state is the torch module's and optimizers' own.
SERVED = ("SingleDeviceStrategy", "DDPStrategy")

FABRICS = Created()


def install(module: Any) -> None:
    """Note every ``Fabric`` the program makes (hook on Fabric's module)."""
    cls = getattr(module, "Fabric", None)
    if isinstance(cls, type):
        note_instances(cls, FABRICS)


def problem() -> Optional[str]:
    """Why a Fabric of this program cannot be followed (None: every one can, or none)."""
    for fabric in FABRICS.alive():
        name = type(getattr(fabric, "strategy", None)).__name__
        if name not in SERVED:
            return "Lightning Fabric's %s keeps the training state its own way (served: %s)" % (
                name,
                ", ".join(SERVED),
            )
    return None


def described() -> str:
    """The Fabric setup, for the line that says the loop is followed ("" without Fabric)."""
    found = []
    for fabric in FABRICS.alive():
        strategy = type(getattr(fabric, "strategy", None)).__name__
        precision = type(getattr(fabric.strategy, "precision", None)).__name__
        found.append("Lightning Fabric: %s, %s" % (strategy, precision))
    return " (%s)" % "; ".join(found) if found else ""

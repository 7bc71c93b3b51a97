"""A loop whose optimizer DeepSpeed's engine steps: why the shim does not follow it.

``deepspeed.initialize`` (directly, or through Accelerate's ``DeepSpeedPlugin``
or Lightning Fabric's DeepSpeed strategy) returns an engine whose ``step``
runs the ZeRO optimizer; that optimizer steps a torch optimizer over flat
partitions of the parameters that belong to no module, and under ZeRO-3 the
modules' own parameters hold nothing outside a gather. The plain loop's
capture would call that "an optimizer over parameters of no module", which
sends the user looking for a bare tensor: the real reason is that the state
is DeepSpeed's, written only by its engine's ``save_checkpoint``, which the
shim does not drive yet. Told by DeepSpeed's runtime being on the stack of
the first optimizer step.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

RUNTIME = "deepspeed.runtime."


def problem() -> Optional[str]:
    """The reason to give when DeepSpeed's engine makes this optimizer step, else None."""
    if "deepspeed" not in sys.modules:
        return None
    found, stage = False, "?"
    frame: Any = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if isinstance(name, str) and name.startswith(RUNTIME):
            found = True
            engine_stage = getattr(frame.f_locals.get("self"), "zero_optimization_stage", None)
            if callable(engine_stage):
                stage = str(engine_stage())
                break
        frame = frame.f_back
    if not found:
        return None
    return (
        "DeepSpeed's engine steps its optimizer (ZeRO stage %s): its state is written by the "
        "engine's own save_checkpoint, which the shim does not drive yet" % stage
    )

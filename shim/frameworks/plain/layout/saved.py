"""This rank's saved state, read back from a plain loop's checkpoint, and why it cannot be used.

The resume begins here: the rank file this rank reads (its own, or under
another number of processes the one ``reshard`` maps it to), the replicated
shares gathered into it (``replicated``), the DeepSpeed engines' files looked
for, and a state written by another number of processes mapped onto this one
where ``reshard`` can (what changes is said once). A torn or foreign file is
never trusted and never raised: it is a reason not to resume.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from .... import dist
from ....log import say
from ...deepspeed import engines as dsengines
from . import replicated, reshard
from . import state as loopstate


def read_saved(directory: str, step: int) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """This rank's saved state (None: none here) and why it cannot resume from it.

    Written by another number of processes, it is mapped onto this one where
    ``reshard`` can (what changes is said once), else it is not used.
    """
    ranks = dist.ranks()
    world, rank = ranks["world_size"], ranks["rank"]
    try:
        old = reshard.saved_world(directory) or world
        source = rank if old == world else reshard.source_rank(rank, old)
        saved = loopstate.read(directory, source)
        if saved is None:
            return None, None
        reason = loopstate.unusable(saved, step, source, old)
        reason = reason or replicated.gather(directory, saved)
        engine_entries = loopstate.saved_by_engines(saved)
        if reason is None and engine_entries:
            reason = dsengines.missing(directory, step, engine_entries, rank)
        if reason is not None or old == world:
            return saved, reason
        if engine_entries:
            return saved, (
                "it was written by %d processes, this job has %d: DeepSpeed's engine "
                "reads its partitions on the layout that wrote them" % (old, world)
            )
        reason, notes = reshard.adapt(saved, old, world, rank)
    except Exception as exc:  # a torn or foreign file: never trusted, never raised
        return None, "its state cannot be read: %s: %s" % (type(exc).__name__, exc)
    if reason is not None:
        return saved, "it was written by %d processes, this job has %d: %s" % (
            old,
            world,
            reason,
        )
    say(
        "checkpoint-%d was written by %d processes, this job has %d: the sharded model and "
        "optimizer are read resharded (DCP); %s" % (step, old, world, "; ".join(notes))
    )
    return saved, None

"""The job's own key-value store, for what the ranks agree on off the training path.

The default process group's store (torchrun's rendezvous store, or the one
``init_process_group`` made): every rank already reaches it, and a wait on a
key is served by the store, with no polling. Each use gets a key space of its
own (its name, the same on every rank, under the launcher's restart count, so
a restarted job never reads an earlier attempt's keys) and connections of its
own (a store client is not to be shared between threads).
"""

from __future__ import annotations

import datetime
import os
from typing import Any, NamedTuple, Optional

PREFIX = "jitckpt"
# The store's own timeout for our waits: long, since a wait that times out is noisy
# (the store client logs it) and a run may train for weeks before a stop.
WAIT = datetime.timedelta(days=30)


class Space(NamedTuple):
    store: Any  # a PrefixStore over a connection of its own
    rank: int
    world: int

    def connection(self) -> Any:
        """Another connection to the same key space (one per thread)."""
        clone = self.store.clone()
        clone.set_timeout(WAIT)
        return clone


def space(name: str) -> Optional[Space]:
    """The key space ``name`` of this job's store, or None for a world of one (no process
    group, or a group of one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    from torch.distributed import distributed_c10d

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store: Any = distributed_c10d._get_default_store()
    store = store.clone()
    own = dist.PrefixStore("%s/%s/%s" % (PREFIX, restart, name), store)
    own.set_timeout(WAIT)
    return Space(own, dist.get_rank(), dist.get_world_size())

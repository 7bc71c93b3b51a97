"""The files of a DeepSpeed checkpoint that only this node's ranks read back (DESIGN 7).

DeepSpeed's ``save_checkpoint`` writes, under its tag's directory
(``global_step<N>``), each data-parallel rank's part of the ZeRO optimizer as
``[bf16_]zero_pp_rank_<R>_mp_rank_<M>_optim_states.pt`` and, under ZeRO-3, its
part of the parameters as ``zero_pp_rank_<R>_mp_rank_<M>_model_states.pt``.
Its ``load_checkpoint`` on the layout that wrote them has rank R read exactly
R's: the model states by R's own name, and of the optimizer files only R's
(``_get_all_zero_checkpoint_state_dicts``), unless the ZeRO config sets
``elastic_checkpoint``, with which every rank reads every rank's. A pod's
checkpoint directory holds what its own ranks wrote, so every such file it
stages is read back by this node only: marked ``local`` (``Staged.local``), a
node downloads its own shards and the files every rank reads (ZeRO 1 and 2's
``mp_rank_<M>_model_states.pt``, ``latest``, HF's own) once.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from .log import failed

ZERO_FILE = re.compile(
    r"(?:[^/]+/)*(?:bf16_)?zero_pp_rank_[0-9]+_mp_rank_[0-9]+_(?:optim|model)_states\.pt"
)


def own(name: str) -> bool:
    """Whether a staged name (relative to the checkpoint) is one rank's ZeRO partition."""
    return ZERO_FILE.fullmatch(name) is not None


def marker(engine: Any) -> Optional[Callable[[str], bool]]:
    """``own`` for the checkpoints of DeepSpeed's ``engine``, or None (nothing is this
    node's alone) when every rank reads every rank's files, or that cannot be told."""
    try:
        elastic = engine.zero_elastic_checkpoint()
    except Exception as exc:
        failed("telling which DeepSpeed checkpoint files are this node's own", exc)
        return None
    return None if elastic else own

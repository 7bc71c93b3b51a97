"""gloo's exit wait alone, for the tests' processes that run without the shim.

A torchrun worker that ends on a gloo collective can die of SIGABRT at exit
("terminate called without an active exception"): the race ``shim/glooexit.py``
describes, which the shim's exit wait fixes for trainers. A test's reference
run or helper worker without the shim would still hit it on a loaded machine,
and a flaky reference is a flaky test. Put this directory first on PYTHONPATH
(the shim, inactive there, is not needed) and the same wait runs at exit,
registered first so that it runs after every other handler.
"""

from __future__ import annotations

import atexit
import os


def _settle(pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child (a DataLoader worker) has no gloo threads of its own
    try:
        from shim import glooexit
    except ImportError:
        return
    glooexit.settle()


atexit.register(_settle, os.getpid())

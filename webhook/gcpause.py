"""Keep the garbage collector's pauses out of admission latency.

Each admission allocates a few hundred short-lived containers (the review, the
pod, the patch; jsonpatch's diff builder even leaves reference cycles), so
CPython's young generation fills every few requests; and every so often a
full collection walks every object the process holds: FastAPI, pydantic,
uvicorn and the kubernetes client are tens of thousands of objects that live
as long as the server. Measured under 8 concurrent clients (3840 admissions,
``bench/admission.py``'s review), full collections took 25 to 82 ms each and
every request in flight waited for them: they made the p99; the collector
took 650 ms in all. ``settle`` moves everything alive once the server is built
into the permanent generation (``gc.freeze``), which no collection walks again:
the same load then saw no pause above 5 ms and 220 ms in all. The young
generation keeps CPython's thresholds: raising them made rarer but longer
pauses (10 to 25 ms each), which a p99 feels more than many short ones.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Call once, after the app and its imports are built and before serving."""
    gc.collect()
    gc.freeze()

"""How long a periodic checkpoint of a plain FSDP2 loop holds training.

`torchrun --nproc-per-node 2` (gloo) of bench/fsdp2_workload.py: a model
sharded per block with ``fully_shard`` and its AdamW state (about 200 MB in
all, 50 MB with ``--quick``), saved at a step boundary either by the shim's
periodic save (``shardedsaves``: DCP's ``async_save``, the copy to host
memory in the loop, the write in a thread) or by a synchronous ``dcp.save``,
alternating in one process pair. The stall is the time the loop is held at
the save plus how much longer the next step took than the steady steps.

    python -m bench.fsdp2_save [--quick] [--reps N]
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bench import harness
from bench.harness import BenchOptions
from bench.procs import tool
from bench.results import Case, Series

NAME = "fsdp2_save"
ASYNC, SYNC = "periodic save (async_save)", "synchronous dcp.save"
ROOT = Path(__file__).parents[1]


def run(options: BenchOptions) -> list[Case]:
    reps = options.repetitions(5, 2)
    dim = "256" if options.quick else "512"
    command = [tool("torchrun"), "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "bench.fsdp2_workload", "--dim", dim, "--reps", str(reps)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    megabytes = result["bytes"] / 1e6
    return [
        Case(
            benchmark=NAME,
            case=f"FSDP2, 2 ranks gloo, {megabytes:.0f} MB of model and AdamW state",
            metric="stall of one save",
            unit="s",
            lower_is_better=True,
            series=[Series(s, result["samples"][s], {"dim": int(dim)}) for s in (ASYNC, SYNC)],
            reference=ASYNC,
            note="fsdp2_save: stall = time held at the save + the next step's excess over "
            f"the steady step ({result['steady_step_s']:.3f} s); the write behind training "
            "shares the 2 ranks' cores",
        )
    ]


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.fsdp2_save", run, __doc__))

"""Every benchmark in one run (`make bench`): same machine, same S3 server, same session.

Each benchmark records its own section of bench/results/latest.json as soon as
it finishes, so a failure in a late one keeps the earlier results; the exit
code says whether all of them ran.

    python -m bench.run_all [--quick] [--reps N] [--only admission,transfer]
"""

from __future__ import annotations

import importlib
import sys
import traceback

from bench import harness

# (name, module, the module's function and its flag that runs it), cheapest first. A
# module may measure two sections: its second behind a flag of its own (``--ddp``).
BENCHMARKS = (
    ("overheads", "bench.overheads", "run", ()),
    ("lightning_overhead", "bench.lightning_overhead", "run", ()),
    ("plainloop_overhead", "bench.plainloop_overhead", "run", ()),
    ("data_replay", "bench.data_replay", "run", ()),
    ("admission", "bench.admission", "run", ()),
    ("transfer", "bench.transfer", "run", ()),
    ("stall", "bench.stall", "run", ()),
    ("fsdp2_save", "bench.fsdp2_save", "run", ()),
    ("restore_bytes", "bench.restore_bytes", "run", ()),
    ("scale", "bench.scale", "run", ()),
    ("scale_ddp", "bench.scale", "run_ddp", ("--ddp",)),
    ("training_wall", "bench.training_wall", "run", ()),
    ("preemption", "bench.preemption", "run", ()),
    ("sigterm_to_durable", "bench.sigterm_to_durable", "run", ()),
    ("sigterm_to_durable_ddp", "bench.sigterm_to_durable", "run_ddp", ("--ddp",)),
    ("time_to_resume", "bench.time_to_resume", "run", ()),
    ("goodput", "bench.goodput", "run", ()),
    ("cluster_preemption", "bench.cluster_preemption", "run", ()),
)


def main() -> int:
    arguments = harness.parser(__doc__ or "run_all")
    arguments.add_argument(
        "--only", default="", help="comma-separated benchmark names (default: all)"
    )
    args = arguments.parse_args()
    options = harness.options_from(args)
    harness.stop_cleanly_on_sigterm()
    chosen = [name for name in args.only.split(",") if name] or [n for n, *_ in BENCHMARKS]
    unknown = set(chosen) - {name for name, *_ in BENCHMARKS}
    if unknown:
        print(f"unknown benchmarks: {sorted(unknown)}", file=sys.stderr)
        return 2
    failed = []
    for name, module, function, flags in BENCHMARKS:
        if name not in chosen:
            continue
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        try:
            bench = getattr(importlib.import_module(module), function)
            harness.execute(name, module, bench, options, flags)
        except Exception:
            traceback.print_exc()
            failed.append(name)
    if failed:
        print(f"[bench] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

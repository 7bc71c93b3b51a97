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

# (name, module), cheapest first.
BENCHMARKS = (
    ("overheads", "bench.overheads"),
    ("lightning_overhead", "bench.lightning_overhead"),
    ("plainloop_overhead", "bench.plainloop_overhead"),
    ("data_replay", "bench.data_replay"),
    ("admission", "bench.admission"),
    ("transfer", "bench.transfer"),
    ("stall", "bench.stall"),
    ("fsdp2_save", "bench.fsdp2_save"),
    ("restore_bytes", "bench.restore_bytes"),
    ("scale", "bench.scale"),
    ("training_wall", "bench.training_wall"),
    ("preemption", "bench.preemption"),
    ("sigterm_to_durable", "bench.sigterm_to_durable"),
    ("time_to_resume", "bench.time_to_resume"),
    ("goodput", "bench.goodput"),
)


def main() -> int:
    arguments = harness.parser(__doc__ or "run_all")
    arguments.add_argument(
        "--only", default="", help="comma-separated benchmark names (default: all)"
    )
    args = arguments.parse_args()
    options = harness.options_from(args)
    harness.stop_cleanly_on_sigterm()
    chosen = [name for name in args.only.split(",") if name] or [n for n, _ in BENCHMARKS]
    unknown = set(chosen) - {name for name, _ in BENCHMARKS}
    if unknown:
        print(f"unknown benchmarks: {sorted(unknown)}", file=sys.stderr)
        return 2
    failed = []
    for name, module in BENCHMARKS:
        if name not in chosen:
            continue
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        try:
            bench = importlib.import_module(module).run
            harness.execute(name, module, bench, options)
        except Exception:
            traceback.print_exc()
            failed.append(name)
    if failed:
        print(f"[bench] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

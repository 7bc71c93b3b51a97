"""What every benchmark command shares: its options, and recording what it measured.

Each `python -m bench.<name>` parses the same flags, runs, writes its section
of bench/results/latest.json and refreshes the table in bench/README.md.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType

from bench import results, table
from bench.results import Case


@dataclass(frozen=True)
class BenchOptions:
    """How hard to measure: `quick` shrinks sizes, `reps` overrides repetitions."""

    quick: bool = False
    reps: int | None = None
    results_path: Path = results.RESULTS_PATH
    readme_path: Path = table.README_PATH

    def repetitions(self, full: int, quick: int) -> int:
        if self.reps is not None:
            return self.reps
        return quick if self.quick else full


BenchFn = Callable[[BenchOptions], list[Case]]


def parser(description: str) -> argparse.ArgumentParser:
    arguments = argparse.ArgumentParser(description=description)
    arguments.add_argument(
        "--quick", action="store_true", help="fewer repetitions and smaller sizes"
    )
    arguments.add_argument(
        "--reps", type=int, default=None, help="repetitions per measurement (overrides)"
    )
    arguments.add_argument("--results", type=Path, default=results.RESULTS_PATH)
    arguments.add_argument("--readme", type=Path, default=table.README_PATH)
    return arguments


def options_from(args: argparse.Namespace) -> BenchOptions:
    return BenchOptions(
        quick=args.quick, reps=args.reps, results_path=args.results, readme_path=args.readme
    )


def command_line(module: str, options: BenchOptions, arguments: Sequence[str] = ()) -> str:
    """The command that reproduces this run, as a user would type it (``arguments``: the
    module's own flags that chose what it ran)."""
    words = [".venv/bin/python", "-m", module, *arguments]
    if options.quick:
        words.append("--quick")
    if options.reps is not None:
        words += ["--reps", str(options.reps)]
    return shlex.join(words)


def execute(
    name: str,
    module: str,
    bench: BenchFn,
    options: BenchOptions,
    arguments: Sequence[str] = (),
) -> list[Case]:
    """Run one benchmark, record it, refresh the README table, print its rows."""
    started = time.monotonic()
    cases = bench(options)
    document = results.record(
        name,
        cases,
        command=command_line(module, options, arguments),
        wall_seconds=time.monotonic() - started,
        options={"quick": options.quick, "reps": options.reps},
        path=options.results_path,
    )
    table.refresh(document, options.readme_path)
    for case in cases:
        for row in table.case_rows(case):
            print(row, flush=True)
    return cases


def stop_cleanly_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so servers and temporary directories are cleaned up."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(
    name: str,
    module: str,
    bench: BenchFn,
    description: str | None,
    argv: Sequence[str] | None = None,
    *,
    ddp: tuple[str, BenchFn] | None = None,
) -> int:
    """Entry point of `python -m <module>`: parse the shared flags, run, record.

    ``ddp``: the module's data-parallel case (its section's name and function), run alone
    with ``--ddp`` and recorded in its own section, so the other one's results stay.
    """
    arguments = parser(description or name)
    if ddp is not None:
        arguments.add_argument(
            "--ddp", action="store_true", help="the data-parallel case alone (its own section)"
        )
    args = arguments.parse_args(argv)
    stop_cleanly_on_sigterm()
    options = options_from(args)
    if ddp is not None and args.ddp:
        name, bench = ddp
    print(f"[bench] {name}: {asdict(options)}", file=sys.stderr, flush=True)
    execute(name, module, bench, options, ["--ddp"] if ddp is not None and args.ddp else [])
    return 0

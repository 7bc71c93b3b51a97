"""What the script itself saved at its end, resumed run against uninterrupted run.

The shim's final weights say whether the training modules came out the same;
they cannot see an EMA, a tracker, a counter, or anything else the script
writes at its end. What the script wrote is what each run's sidecar uploaded
to its job's ``final/`` (read back through the commit record, each file
checked against its size and CRC32C), so the demo downloads both and compares
them file by file (``weights.compare_saved``): the runs must have saved the
same files, equal tensor by tensor and value by value (byte for byte for
files that are neither ``torch.save`` archives nor safetensors).

One file is left out, and named as left out: HF's ``training_args.bin``, a
pickle of the Trainer's arguments, which hold the run's paths and times (its
``output_dir``, its ``logging_dir``), so two runs differ there by nature, and
which holds nothing training produced.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from local.demo.weights import WHOLE_FILE, compare_saved
from sidecar import final
from sidecar.storage.base import Store

# Files that describe a run rather than hold its result, by name: why each is not compared.
NOT_RESULTS = {"training_args.bin": "HF Trainer's arguments (the run's paths and times)"}


@dataclass
class SavedComparison:
    """The verdict on the two runs' ``final/``; ``equal`` None: not compared."""

    equal: bool | None
    detail: str
    files: list[str] = field(default_factory=list)
    differing: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # saved, but not a result: not compared

    def summary(self) -> dict[str, Any]:
        return {
            "equal": self.equal,
            "detail": self.detail,
            "files": self.files,
            "differing": self.differing,
            "not_compared": self.skipped,
        }


async def download(store: Store, into: Path) -> list[str] | None:
    """The committed final model's files, under ``into`` (None: there is none). Raises
    ``ValueError`` when it is torn."""
    state = await final.judge(store)
    if state is None:
        return None
    if not state.valid or state.record is None:
        raise ValueError(f"its final/ is torn: {state.reason}")
    names = []
    run = state.record.run
    for entry in state.files:  # paths validated by the record's manifest: relative, normalized
        target = into / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            await store.get_file(final.file_key(run, entry.path), fd, entry.size, entry.crc32c)
        finally:
            os.close(fd)
        names.append(entry.path)
    return sorted(names)


def fetch(open_store: Any, into: Path) -> list[str] | None:
    async def run() -> list[str] | None:
        async with open_store() as store:
            return await download(store, into)

    return asyncio.run(run())


def compare_runs(resumed: tuple[Any, Path], reference: tuple[Any, Path]) -> SavedComparison:
    """Compare what two jobs' ``final/`` hold; each side is (a store opener, a local dir)."""
    try:
        got = fetch(*resumed)
        want = fetch(*reference)
    except ValueError as exc:
        return SavedComparison(False, str(exc))
    if got is None and want is None:
        return SavedComparison(
            True, "neither run saved files the shim uploads to final/: only the weights compared"
        )
    if got is None or want is None:
        which = "resumed" if got is None else "uninterrupted"
        return SavedComparison(False, f"the {which} run saved nothing to final/")
    skipped = sorted(n for n in set(got) | set(want) if n.rsplit("/", 1)[-1] in NOT_RESULTS)
    differing = [
        f"{name} (in one run only)" for name in sorted(set(got) ^ set(want)) if name not in skipped
    ]
    for name in sorted(set(got) & set(want) - set(skipped)):
        for where in compare_saved(reference[1] / name, resumed[1] / name):
            differing.append(name if where == WHOLE_FILE else f"{name}: {where}")
    files = sorted((set(got) | set(want)) - set(skipped))
    left_out = "".join(
        f"; not compared: {name}, {NOT_RESULTS[name.rsplit('/', 1)[-1]]}" for name in skipped
    )
    if differing:
        shown = ", ".join(differing[:5]) + (" ..." if len(differing) > 5 else "")
        return SavedComparison(False, f"differ in {shown}{left_out}", files, differing, skipped)
    return SavedComparison(
        True,
        f"{', '.join(files)}: equal tensor by tensor and value by value{left_out}",
        files,
        skipped=skipped,
    )

"""Restore against generated store contents (issue 22, class 1): it always ends in
"restored a valid checkpoint" or "nothing to restore", never in an exception, and it
writes nothing outside its target directory.

The store is a real ``pvc://`` job root (a directory, the same code as a mounted
claim). Each example plants a few checkpoints, each made by one or two nodes, with
file names drawn from a set that includes clashes (``d0`` and ``d0/f``), traversal
and control characters, and one damage from a list of what a hostile or broken
store holds: a missing manifest, bytes that do not match the manifest, a symlink to
a file outside the job root where an object or a manifest should be, a FIFO, a
directory, invalid JSON, a sparse file larger than the local volume. The newest
intact checkpoint (or a newer one whose damage does not matter) must be restored,
byte for byte what its manifests list.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import tempfile
from pathlib import Path

import google_crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar import checksum
from sidecar.restore import restore
from sidecar.storage.pvc import DirectoryStore

NAMES = ["m", "d0", "d0/f", "a/b", "a/b/c", "x y", ".jitckpt/x", "../up", "/abs", "n\nl", "s/../m"]
VALID_NAMES = {"m", "d0", "d0/f", "a/b", "a/b/c", "x y"}
# Damage that leaves a checkpoint restorable as its manifests say.
HARMLESS = {"none", "extra object", "extra manifest"}
DAMAGE = [
    "none",
    "none",
    "extra object",
    "extra manifest",
    "no manifest",
    "flipped byte",
    "short file",
    "symlink object",
    "symlink manifest",
    "fifo object",
    "directory object",
    "invalid json",
    "wrong nnodes",
    "sparse huge object",
]


# (step, nnodes, each node's files, damage), one per checkpoint
Planted = list[tuple[int, int, list[dict[str, bytes]], str]]


def _crc(body: bytes) -> str:
    return checksum.encode(google_crc32c.value(body))


@st.composite
def checkpoints(draw: st.DrawFn) -> Planted:
    """(step, nnodes, each node's files, damage) for 1 to 4 checkpoints."""
    steps = draw(st.lists(st.integers(0, 40), min_size=1, max_size=4, unique=True))
    found = []
    for step in steps:
        nnodes = draw(st.integers(1, 2))
        nodes = [
            draw(
                st.dictionaries(
                    st.sampled_from(NAMES), st.binary(min_size=0, max_size=40), max_size=3
                )
            )
            for _ in range(nnodes)
        ]
        found.append((step, nnodes, nodes, draw(st.sampled_from(DAMAGE))))
    return found


def _intact(nodes: list[dict[str, bytes]], damage: str) -> bool:
    union: dict[str, bytes] = {}
    for files in nodes:
        for name, body in files.items():
            if union.setdefault(name, body) != body:
                return False  # two nodes, one name, different bytes
    names = set(union)
    clash = any(a != b and b.startswith(a + "/") for a in names for b in names)
    return damage in HARMLESS and names <= VALID_NAMES and not clash


def _plant(root: Path, outside: Path, planted: Planted) -> Planted:
    """The checkpoints in the store, with the damage each one really got."""
    done = []
    for step, nnodes, nodes, damage in planted:
        top = root / f"checkpoint-{step}"
        (top / ".jitckpt").mkdir(parents=True, exist_ok=True)
        for rank, files in enumerate(nodes):
            entries = []
            for name, body in files.items():
                entries.append({"path": name, "size": len(body), "crc32c": _crc(body), "parts": 1})
                if name in VALID_NAMES:
                    path = top / name
                    try:
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_bytes(body)
                    except OSError:
                        pass  # a clash in the store itself: the object is missing
            manifest = {
                "version": 1, "step": step, "kind": "periodic", "node_rank": rank,
                "nnodes": nnodes, "pod": "p", "job": "j", "time": "2025-01-01T00:00:00+00:00",
                "files": entries,
            }  # fmt: skip
            (top / ".jitckpt" / f"node-{rank}.json").write_text(json.dumps(manifest))
        done.append((step, nnodes, nodes, _damage(top, outside, damage)))
    return done


def _damage(top: Path, outside: Path, damage: str) -> str:
    """Apply ``damage`` to the checkpoint at ``top``; what was done ("none": nothing)."""
    objects = sorted(p for p in top.rglob("*") if p.is_file() and ".jitckpt" not in p.parts)
    manifest = top / ".jitckpt" / "node-0.json"
    target = objects[0] if objects else None
    if damage == "extra object":
        (top / "zz-extra").write_bytes(b"not listed")
    elif damage == "extra manifest":
        (top / ".jitckpt" / "node-7.json").write_bytes(b"\x1b[2J not json")
    elif damage == "no manifest":
        manifest.unlink()
    elif damage == "invalid json":
        manifest.write_bytes(b'{"version": 1, "files": [')
    elif damage == "wrong nnodes":
        doc = json.loads(manifest.read_text())
        doc["nnodes"] = 3
        manifest.write_text(json.dumps(doc))
    elif damage == "symlink manifest":
        copy = outside / f"manifest-{top.name}.json"
        copy.write_bytes(manifest.read_bytes())
        manifest.unlink()
        manifest.symlink_to(copy)
    elif target is None:
        return "none"
    elif damage == "flipped byte" and target.stat().st_size:
        body = bytearray(target.read_bytes())
        body[0] ^= 0xFF
        target.write_bytes(bytes(body))
    elif damage == "short file" and target.stat().st_size:
        target.write_bytes(target.read_bytes()[:-1])
    elif damage == "symlink object":
        canary = outside / f"canary-{top.name}"
        canary.write_bytes(target.read_bytes())  # same bytes: only the link is wrong
        target.unlink()
        target.symlink_to(canary)
    elif damage == "fifo object":
        target.unlink()
        os.mkfifo(target)
    elif damage == "directory object":
        target.unlink()
        target.mkdir()
    elif damage == "sparse huge object":
        with target.open("r+b") as handle:
            handle.truncate(1 << 43)  # 8 TiB, no blocks: more than the local volume
        doc = json.loads(manifest.read_text())
        for entry in doc["files"]:
            if entry["path"] == target.relative_to(top).as_posix():
                entry["size"] = 1 << 43
        manifest.write_text(json.dumps(doc))
    elif damage not in HARMLESS:
        return "none"  # "flipped byte" or "short file" of an empty file
    return damage


def tree_snapshot(root: Path) -> dict[str, tuple[int, int, bytes | str | None]]:
    """Each entry under ``root``, never following a symlink: mode, size, and the bytes of
    a small file or the target of a link (a sparse 8 TiB file is not read)."""
    found: dict[str, tuple[int, int, bytes | str | None]] = {}
    for here, dirs, files in os.walk(root):
        for name in [".", *dirs, *files]:
            path = Path(here) / name
            info = path.lstat()
            content: bytes | str | None = None
            if path.is_symlink():
                content = os.readlink(path)
            elif path.is_file() and info.st_size < 1 << 20:
                content = path.read_bytes()
            found[path.relative_to(root).as_posix()] = (info.st_mode, info.st_size, content)
    return found


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(planted=checkpoints())
def test_restore_ends_in_a_valid_checkpoint_or_nothing(
    planted: Planted,
) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch)
        root, outside, local = base / "claim" / "ns" / "job", base / "outside", base / "local"
        root.mkdir(parents=True)
        outside.mkdir()
        (outside / "keep").write_bytes(b"keep")
        planted = _plant(root, outside, planted)
        store_before, outside_before = tree_snapshot(root), tree_snapshot(outside)

        result = asyncio.run(restore(DirectoryStore(root, "pvc://c/ns/job"), local / "checkpoints"))

        assert tree_snapshot(outside) == outside_before
        assert tree_snapshot(root) == store_before  # a restore never changes the store
        by_step = {step: (nodes, damage) for step, _, nodes, damage in planted}
        intact = [s for s, (nodes, damage) in by_step.items() if _intact(nodes, damage)]
        checkpoints = local / "checkpoints"
        left = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.exists() else []
        if result.step is None:
            assert not intact, (intact, result.skipped)
            assert result.reason and left == []
            return
        assert result.step >= max(intact, default=-1), (result.step, intact, result.skipped)
        nodes, damage = by_step[result.step]
        assert _intact(nodes, damage), (result.step, damage, nodes)
        assert left == [f"checkpoint-{result.step}"]
        restored = local / "checkpoints" / left[0]
        expected = {name: body for files in nodes for name, body in files.items()}
        found = {
            p.relative_to(restored).as_posix(): p.read_bytes()
            for p in restored.rglob("*")
            if p.is_file()
        }
        assert found == expected
        # Every newer checkpoint the store holds a file of was skipped, said once each (one
        # planted with no file left, say an empty one whose manifest was removed, is not there).
        held = {
            int(key.split("/")[0].removeprefix("checkpoint-"))
            for key, (mode, _, _) in store_before.items()
            if key.startswith("checkpoint-") and stat.S_ISREG(mode)
        }
        skipped = [s.step for s in result.skipped]
        assert len(skipped) == len(set(skipped)), result.skipped
        assert set(skipped) == {s for s in held if s > result.step}, result.skipped

"""The one validation of a manifest (and of staged names): what the store or the trainer
may send, and what is refused before anything uses it."""

from __future__ import annotations

import json

import pytest

from sidecar import checksum
from sidecar import manifest as mf

GOOD_ENTRY = {"path": "model.bin", "size": 3, "crc32c": "AAAAAA==", "parts": 1}


def _manifest(**fields: object) -> bytes:
    body: dict[str, object] = {
        "version": 1,
        "step": 5,
        "kind": "jit",
        "node_rank": 0,
        "nnodes": 2,
        "pod": "p",
        "job": "j",
        "time": "2025-01-01T00:00:00+00:00",
        "files": [GOOD_ENTRY],
    }
    body.update(fields)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "path",
    ["model.bin", "global_step10/mp_rank_00_model_states.pt", "a b/ü.json", "x/.jitckpt/y"],
)
def test_names_a_checkpoint_may_carry(path: str) -> None:
    assert mf.check_path(path) == path


@pytest.mark.parametrize(
    ("path", "rule"),
    [
        ("", "empty"),
        ("/etc/passwd", "absolute"),
        ("../x", "not normalized"),
        ("a/../../x", "not normalized"),
        ("a//b", "not normalized"),
        ("./a", "not normalized"),
        ("a/", "not normalized"),
        ("a\\..\\b", "backslash"),
        ("a\x00b", "control character"),
        ("a\nb", "control character"),
        (".jitckpt/node-1.json", "holds manifests only"),
        ("/".join(["d"] * 40), "levels deep"),
        ("x" * 300, "longer than 255"),
        ("/".join(["y" * 200] * 6), "longer than 1024"),
    ],
)
def test_names_refused(path: str, rule: str) -> None:
    with pytest.raises(mf.PathError, match=rule):
        mf.check_path(path)


def _pieced(
    sizes: tuple[int, ...] = (6, 5),
    crcs: tuple[str, ...] = ("hello ", "world"),
    nodes: tuple[int, ...] = (0, 1),
) -> dict[str, object]:
    """The entry of the 11-byte file "hello world" stored in pieces; each piece's CRC32C
    is that of the text given for it."""
    return {
        "path": "model.bin",
        "size": 11,
        "crc32c": checksum.of_bytes(b"hello world"),
        "pieces": [
            {"node": n, "size": s, "crc32c": checksum.of_bytes(c.encode())}
            for n, s, c in zip(nodes, sizes, crcs, strict=False)
        ],
    }


def test_a_file_in_pieces_round_trips_with_its_offsets() -> None:
    manifest = mf.decode(_manifest(files=[_pieced()]))
    assert manifest.files[0].offsets() == [0, 6]
    assert mf.decode(mf.encode(manifest)) == manifest


def test_a_valid_manifest_round_trips() -> None:
    manifest = mf.decode(_manifest())
    assert manifest.nnodes == 2 and manifest.files[0].path == "model.bin"
    assert mf.decode(mf.encode(manifest)) == manifest


@pytest.mark.parametrize(
    ("fields", "rule"),
    [
        ({"nnodes": 0}, "greater than or equal to 1"),
        ({"nnodes": mf.MAX_NODES + 1}, "less than or equal to"),
        ({"nnodes": True}, "valid integer"),
        ({"nnodes": "2"}, "valid integer"),
        ({"nnodes": 2.0}, "valid integer"),
        ({"node_rank": 2}, "is not below nnodes"),
        ({"step": -1}, "greater than or equal to 0"),
        ({"step": 10**30}, "less than or equal to"),
        ({"kind": "weird"}, "kind must be one of"),
        ({"version": 2}, "Input should be 1"),
        ({"files": [GOOD_ENTRY, GOOD_ENTRY]}, "listed twice"),
        ({"files": [dict(GOOD_ENTRY, path="../../x")]}, "not normalized"),
        ({"files": [dict(GOOD_ENTRY, path="/abs")]}, "absolute"),
        ({"files": [dict(GOOD_ENTRY, path=".jitckpt/node-1.json")]}, "manifests only"),
        ({"files": [dict(GOOD_ENTRY, size=-1)]}, "greater than or equal to 0"),
        ({"files": [dict(GOOD_ENTRY, crc32c="x" * 4000)]}, "should match pattern"),
        ({"files": [dict(GOOD_ENTRY, parts=0)]}, "greater than or equal to 1"),
        ({"files": [GOOD_ENTRY] * (mf.MAX_FILES + 1)}, "at most"),
        ({"pod": "p" * 1000}, "at most 253"),
        ({"files": [_pieced(sizes=(6, 4))]}, "are not its 11 bytes"),
        ({"files": [_pieced(crcs=("world", "hello"))]}, "are not its CRC32C"),
        ({"files": [_pieced(sizes=(11,), crcs=("hello world",))]}, "is one piece"),
        ({"files": [_pieced(nodes=(0, 2))]}, "names a node beyond nnodes"),
        ({"sent": [{"path": "../x", "index": 1, "size": 1, "crc32c": "AAAAAA=="}]}, "normal"),
    ],
)
def test_manifests_refused(fields: dict[str, object], rule: str) -> None:
    with pytest.raises(ValueError, match=rule):
        mf.decode(_manifest(**fields))


def test_a_manifest_over_the_cap_is_refused_unparsed() -> None:
    data = _manifest() + b" " * mf.MAX_MANIFEST_BYTES
    with pytest.raises(ValueError, match="more than the"):
        mf.decode(data)


@pytest.mark.parametrize("data", [b"[" * 100_000, b'{"step": 1e999}', b"not json", b"{}"])
def test_malformed_json_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        mf.decode(data)

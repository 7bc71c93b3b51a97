"""Downloaded pieces are written where they belong without being joined first."""

from __future__ import annotations

import os
import random
from pathlib import Path

from sidecar.storage.s3 import IOV_BATCH, _pwrite_all


def test_many_pieces_of_any_size_land_in_order_at_the_offset(tmp_path: Path) -> None:
    rng = random.Random(7)
    pieces = [
        os.urandom(rng.choice((0, 1, 17, 4096, 65536, 300_000))) for _ in range(3 * IOV_BATCH)
    ]
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"head", 0)
        _pwrite_all(fd, pieces, 4)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"head" + b"".join(pieces)

"""SIGTERM to committed has a floor: the next step's end, the save, and the upload alone."""

from __future__ import annotations

import pytest

from bench.sigterm_to_durable import Outcome


def test_the_floor_is_the_save_done_plus_the_upload_alone() -> None:
    # SIGTERM, 0.5 s to the step's end and the save, the trainer gone 3 s later (teardown),
    # then 1.25 s of s5cmd cp: the floor leaves the teardown out
    outcome = Outcome(4.75, 3.5, 0, 1000, upload_seconds=1.25, saved_seconds=0.5)
    assert outcome.floor_seconds == pytest.approx(1.75)


def test_a_run_without_its_save_or_upload_timed_has_no_floor() -> None:
    assert Outcome(4.0, 3.0, 143, 1000).floor_seconds is None
    assert Outcome(4.0, 3.0, 0, 1000, upload_seconds=1.0).floor_seconds is None

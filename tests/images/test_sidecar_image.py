"""The sidecar image's ``jitckpt agent`` takes a job through a preemption.

``jitckpt demo --sidecar-image``: every sidecar of the job's pods runs from the
built image's root (the local pod runner's ``image_roots``), as the image's
user with the read-only root the injected securityContext asks for, against
the embedded S3 server. The trainers run this machine's interpreter and load
the shim the agent copied into their pod's volume from the image.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

from shim import layout
from tests.e2e.support import SCRIPT, script_args
from tests.images.support import ENV_IMAGES, written_to_root


@pytest.mark.slow
def test_a_demo_job_is_preempted_and_resumed_by_the_image_s_agent(
    sidecar_image: object, tmp_path: Path
) -> None:
    export = Path(os.environ[ENV_IMAGES]) / "sidecar"
    workdir = tmp_path / "demo"
    jitckpt = Path(sys.executable).with_name("jitckpt")
    argv = [str(jitckpt), "demo", "--script", str(SCRIPT), "--nnodes", "2", "--compare"]
    argv += ["--json", "--keep", "--workdir", str(workdir), "--sidecar-image", str(export)]
    done = subprocess.run(
        [*argv, "--", *script_args(tmp_path)],
        capture_output=True,
        text=True,
        timeout=540,  # under the suite's 600 s per test, so a slow run still reports
        check=False,
    )
    (line,) = done.stdout.splitlines()
    summary = json.loads(line)
    assert summary["ok"] is True, (summary, done.stderr[-4000:])
    assert summary["committed"] is True
    assert summary["resumed_from_step"] == summary["jit_checkpoint_step"] is not None
    assert summary["equal_to_uninterrupted"] is True
    assert summary["destination"].startswith("s3://")
    # Each sidecar ran from the image (an overlay on its root) and wrote nothing to it.
    roots = sorted((workdir / "node" / "pods").glob("*/containers/jitckpt-agent/root/upper"))
    assert len(roots) >= 4, "two pods preempted, two resumed, each with its sidecar"
    # The sidecar's volume mounts, where the runtime makes its mount points; /var/run is
    # Debian's link to /run, so those are made under run/ inside the image.
    mounts = (layout.LOCAL_DIR, layout.RUN_DIR, layout.SHIM_ROOT, layout.S3_SECRET_DIR)
    mount_points = {
        str(PurePosixPath(m).relative_to("/")).replace("var/run/", "run/", 1) for m in mounts
    }
    for upper in roots:
        assert written_to_root(upper, mount_points) == set(), upper

"""The agent's settings from env (layout names, defaults) and job-root parsing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from shim import layout
from sidecar.config import AgentConfig
from sidecar.uri import DestinationError, parse_job_root

# The node a sidecar runs on: the webhook always sets both.
NODE = {layout.ENV_NNODES: "1", layout.ENV_NODE_RANK: "0"}


def test_from_env_reads_the_injected_names() -> None:
    config = AgentConfig.from_env(
        {
            layout.ENV_DESTINATION: "s3://bkt/p/ns/job",
            layout.ENV_NODE_RANK: "2",
            layout.ENV_NNODES: "4",
            layout.ENV_RETENTION: "3",
            layout.ENV_VERIFY_SSL: "false",
            layout.ENV_VERIFY_ACCESS: "False",
            layout.ENV_RESUME: "true",
            layout.ENV_GRACE_SECONDS: "600",
            layout.ENV_MODE: "legacy",
            layout.ENV_DIR: "/x/local",
            layout.ENV_SOCKET: "/x/run/agent.sock",
            layout.ENV_STATUS_PORT: "9000",
            layout.ENV_POD_IP: "10.0.0.7",
        }
    )
    assert (config.node_rank, config.nnodes, config.retention) == (2, 4, 3)
    assert (config.verify_ssl, config.verify_access, config.resume) == (False, False, True)
    assert config.grace_seconds == 600 and config.mode == "legacy"
    assert config.staging_dir == Path("/x/local") / layout.STAGING_SUBDIR
    assert config.pids_dir == Path("/x/run") / layout.PIDS_SUBDIR
    assert (config.pod_ip, config.status_port) == ("10.0.0.7", 9000)


def test_defaults_are_the_layout_ones() -> None:
    config = AgentConfig.from_env({layout.ENV_DESTINATION: "pvc://c/p", **NODE})
    assert config.local_dir == Path(layout.LOCAL_DIR)
    assert config.socket_path == Path(layout.SOCKET_PATH)
    assert config.pvc_mount == Path(layout.PVC_MOUNT)
    assert config.status_port == layout.STATUS_PORT
    assert (config.retention, config.resume, config.verify_access) == (0, True, True)


@pytest.mark.parametrize(
    "env",
    [
        {**NODE},
        {layout.ENV_DESTINATION: "s3://bkt/p", **NODE, layout.ENV_RESUME: "maybe"},
        {layout.ENV_DESTINATION: "s3://bkt/p", **NODE, layout.ENV_MODE: "sidecar"},
        {layout.ENV_DESTINATION: "s3://bkt/p", **NODE, "JITCKPT_PART_SIZE": "1024"},
    ],
)
def test_invalid_settings_are_refused(env: dict[str, str]) -> None:
    with pytest.raises((ValidationError, ValueError)):
        AgentConfig.from_env(env)


def test_job_roots() -> None:
    s3 = parse_job_root("s3://bkt/team/ns-a/job-1/", Path("/m"))
    assert (s3.scheme, s3.bucket, s3.prefix, s3.uri) == (
        "s3",
        "bkt",
        "team/ns-a/job-1",
        "s3://bkt/team/ns-a/job-1",
    )
    pvc = parse_job_root("pvc://claim/ckpt/ns-a/job-1", Path("/mnt/c"))
    assert (pvc.scheme, pvc.path) == ("file", Path("/mnt/c/ckpt/ns-a/job-1"))
    assert parse_job_root("/data/job", Path("/m")).path == Path("/data/job")
    assert s3.child_uri("checkpoint-5") == "s3://bkt/team/ns-a/job-1/checkpoint-5"
    for bad in ("s3://", "s3://bkt/../x", "pvc:///x", "gs://b/x", ""):
        with pytest.raises(DestinationError):
            parse_job_root(bad, Path("/m"))


@pytest.mark.parametrize(
    ("destination", "expected"),
    [("", "JITCKPT_DESTINATION is empty"), ("gs://b/x", "only s3:// and pvc://")],
)
def test_agent_refuses_bad_settings_with_exit_2(destination: str, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITCKPT_")}
    env.update({layout.ENV_DESTINATION: destination, **NODE})
    done = subprocess.run(
        [str(Path(sys.executable).parent / "jitckpt"), "agent"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "invalid settings" in done.stderr and expected in done.stderr


def test_downloads_have_their_own_range_size_and_concurrency() -> None:
    from sidecar import config as cfg

    defaults = AgentConfig.from_env({layout.ENV_DESTINATION: "s3://bkt/p", **NODE})
    assert (defaults.download_range_size, defaults.download_concurrency) == (64 << 20, 8)
    assert (defaults.part_size, defaults.concurrency) == (16 << 20, 4)
    tuned = AgentConfig.from_env(
        {
            layout.ENV_DESTINATION: "s3://bkt/p",
            **NODE,
            cfg.ENV_DOWNLOAD_RANGE_SIZE: str(32 << 20),
            cfg.ENV_DOWNLOAD_CONCURRENCY: "16",
        }
    )
    assert (tuned.download_range_size, tuned.download_concurrency) == (32 << 20, 16)
    with pytest.raises(ValidationError):
        AgentConfig.from_env(
            {layout.ENV_DESTINATION: "s3://bkt/p", **NODE, cfg.ENV_DOWNLOAD_RANGE_SIZE: "1"}
        )


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        ({}, "JITCKPT_NNODES is not set"),
        ({layout.ENV_NNODES: "2"}, "JITCKPT_NODE_RANK is not set"),
        ({layout.ENV_NODE_RANK: "0"}, "JITCKPT_NNODES is not set"),
        ({layout.ENV_NNODES: "1:4", layout.ENV_NODE_RANK: "0"}, "JITCKPT_NNODES='1:4'"),
        ({layout.ENV_NNODES: "", layout.ENV_NODE_RANK: "0"}, "JITCKPT_NNODES is not set"),
        ({layout.ENV_NNODES: "0", layout.ENV_NODE_RANK: "0"}, "JITCKPT_NNODES='0'"),
        ({layout.ENV_NNODES: "\u00b2", layout.ENV_NODE_RANK: "0"}, "is not an integer"),
        ({layout.ENV_NNODES: "99999", layout.ENV_NODE_RANK: "0"}, "from 1 to 10000"),
        ({layout.ENV_NNODES: "2", layout.ENV_NODE_RANK: "-1"}, "JITCKPT_NODE_RANK='-1'"),
        ({layout.ENV_NNODES: "2", layout.ENV_NODE_RANK: "2"}, "not below the node count 2"),
        (
            {layout.ENV_NNODES: "2", layout.ENV_NODE_RANK: "1", layout.ENV_NODE_RANK_OFFSET: "1"},
            "not below the node count 2",
        ),
    ],
)
def test_the_agent_never_guesses_its_node(nodes: dict[str, str], expected: str) -> None:
    """Unknown node count or rank: refused with a clear message, never nnodes=1 / rank 0."""
    with pytest.raises(ValueError, match=re.escape(expected)):
        AgentConfig.from_env({layout.ENV_DESTINATION: "s3://bkt/ns/job", **nodes})


def test_an_agent_without_its_node_exits_2_with_the_reason() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITCKPT_")}
    env.update({layout.ENV_DESTINATION: "s3://bkt/ns/job", layout.ENV_NNODES: "1:4"})
    done = subprocess.run(
        [str(Path(sys.executable).parent / "jitckpt"), "agent"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "invalid settings" in done.stderr and "JITCKPT_NNODES='1:4'" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_worker_rank_is_the_replica_index_plus_the_offset() -> None:
    env = {
        layout.ENV_DESTINATION: "s3://bkt/ns/job",
        layout.ENV_NNODES: "4",
        layout.ENV_NODE_RANK: "2",
        layout.ENV_NODE_RANK_OFFSET: "1",
    }
    assert AgentConfig.from_env(env).node_rank == 3

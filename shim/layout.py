"""Names every part agrees on: mount paths, file names and environment variables.

The webhook writes these into the pod spec, the sidecar and the shim read them
back. They live in the shim package because the shim may only use the standard
library and must be importable on its own inside the user's Python; the webhook
and the sidecar import this module rather than repeating the strings.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

# Volumes the webhook mounts into the trainer and the sidecar.
LOCAL_DIR = "/mnt/jitckpt"  # jitckpt-local: checkpoints, staging
RUN_DIR = "/var/run/jitckpt"  # jitckpt-run (Memory): socket, pid files
SHIM_ROOT = "/opt/jitckpt"  # jitckpt-shim: the sidecar copies the shim here
SHIM_DIR = SHIM_ROOT + "/shim"  # what PYTHONPATH points at
SOCKET_PATH = RUN_DIR + "/agent.sock"
PVC_MOUNT = "/mnt/jitckpt-pvc"  # jitckpt-pvc: the claim of a pvc:// destination (sidecar only)
# jitckpt-s3-secret: the s3-secret's keys as read-only files (sidecar only), which the
# kubelet swaps atomically when the Secret is rotated.
S3_SECRET_DIR = "/var/run/secrets/jitckpt/s3"

# Inside LOCAL_DIR.
CHECKPOINTS_SUBDIR = "checkpoints"  # HF writes checkpoint-<step>/ here; restore lands here
STAGING_SUBDIR = "staging"  # staging/<id>/: hard links owned by the sidecar
# Inside RUN_DIR.
PIDS_SUBDIR = "pids"  # pids/<pid>.pid: processes the preStop hook signals

CHECKPOINT_PREFIX = "checkpoint-"
MANIFEST_DIR = ".jitckpt"  # <root>/checkpoint-<step>/.jitckpt/node-<k>.json
# <root>/final/: the trained model of the last run that finished (sidecar/final.py).
FINAL_DIR = "final"

# Exit code of a trainer after a JIT save: 128 + SIGTERM, never success.
JIT_EXIT_CODE = 143
# In every line where the shim leaves a training alone (a loop or a run it cannot resume
# exactly): what the demo looks for in a trainer's log when no step was held for it.
NO_JIT = "gets no JIT"

# The sidecar's container name (native init container or legacy run container),
# also the component its Events and log lines name.
AGENT_CONTAINER = "jitckpt-agent"

# Trainer container environment (set by the webhook, read by the shim).
ENV_DIR = "JITCKPT_DIR"
ENV_SOCKET = "JITCKPT_SOCKET"
ENV_GRACE_SECONDS = "JITCKPT_GRACE_SECONDS"
ENV_JIT = "JITCKPT_JIT"
ENV_UPLOAD_FINAL = "JITCKPT_UPLOAD_FINAL"  # hand the final model to the sidecar at a normal end
ENV_SAVE_STRATEGY = "JITCKPT_SAVE_STRATEGY"
ENV_SAVE_STEPS = "JITCKPT_SAVE_STEPS"
ENV_SAVE_TOTAL_LIMIT = "JITCKPT_SAVE_TOTAL_LIMIT"
ENV_TORCH_SHUTDOWN = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
# Set only in the pods `jitckpt demo` generates, never by the webhook: hold at this
# step until SIGTERM arrives (the demo preempts at an exact step), and write the
# trained model's weights to this file at the normal end (for `--compare`).
ENV_DEMO_HOLD_AT_STEP = "JITCKPT_DEMO_HOLD_AT_STEP"
ENV_DEMO_FINAL_WEIGHTS = "JITCKPT_DEMO_FINAL_WEIGHTS"
# Beside those weights, the trainer's log history where the framework keeps one (HF's
# ``state.log_history``), as JSON: the demo's verdict compares it too.
DEMO_LOG_SUFFIX = ".log.json"


def demo_log_path(weights: str) -> str:
    """Where the demo's log history goes, beside the final weights at ``weights``."""
    return weights + DEMO_LOG_SUFFIX


# Sidecar container environment (set by the webhook, read by the sidecar).
ENV_DESTINATION = "JITCKPT_DESTINATION"  # the job's root: <destination>/<namespace>/<job>
ENV_JOB_NAME = "JITCKPT_JOB_NAME"
ENV_NODE_RANK = "JITCKPT_NODE_RANK"  # copied from the trainer (literal or fieldRef)
# Added to ENV_NODE_RANK when that is a PyTorchJob replica-index label: set by
# `jitckpt inject` on worker templates, whose node rank is the index + 1.
ENV_NODE_RANK_OFFSET = "JITCKPT_NODE_RANK_OFFSET"
ENV_NNODES = "JITCKPT_NNODES"
# Copied from the trainer's PET_NPROC_PER_NODE when it has one: with the node count
# it is the job's layout, which says whether a node's own checkpoint files are what
# its ranks read on resume. Optional: unknown (absent, "auto", "gpu") means another.
ENV_NPROC_PER_NODE = "JITCKPT_NPROC_PER_NODE"
# The most nodes a job may have: what the webhook copies, the sidecar accepts
# and a manifest may state are all held to it.
MAX_NNODES = 10000
ENV_POD_NAME = "JITCKPT_POD_NAME"  # fieldRef metadata.name
ENV_POD_NAMESPACE = "JITCKPT_POD_NAMESPACE"  # fieldRef metadata.namespace
ENV_POD_IP = "JITCKPT_POD_IP"  # fieldRef status.podIP: where the status server binds
ENV_STATUS_PORT = "JITCKPT_STATUS_PORT"
ENV_RETENTION = "JITCKPT_S3_RETENTION"
ENV_PIECE_MIN_SIZE = "JITCKPT_PIECE_MIN_SIZE"  # bytes: the sidecar's smallest upload piece
ENV_VERIFY_SSL = "JITCKPT_VERIFY_SSL"
ENV_VERIFY_ACCESS = "JITCKPT_VERIFY_ACCESS"
ENV_RESUME = "JITCKPT_RESUME"
ENV_STORE_UNREACHABLE = "JITCKPT_STORE_UNREACHABLE"  # "run-unprotected" or "fail-closed"
ENV_MODE = "JITCKPT_MODE"  # "native" or "legacy"
ENV_PVC_MOUNT = "JITCKPT_PVC_MOUNT"  # where the claim of pvc:// is mounted
ENV_S3_SECRET_DIR = "JITCKPT_S3_SECRET_DIR"  # where the s3-secret's files are mounted

STATUS_PORT = 8471


def step_of(name: str) -> Optional[int]:
    """The step of a name that is exactly ``checkpoint-<step>``, else None.

    Only the canonical spelling counts (ASCII digits, no sign, no leading zero),
    so a name read from a directory or a store maps to one step and back.
    """
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    digits = name[len(CHECKPOINT_PREFIX) :]
    if not (digits.isascii() and digits.isdigit()) or str(int(digits)) != digits:
        return None
    return int(digits)


def shutdown_timeout(grace_seconds: int) -> int:
    """torchrun's budget for its workers' exit (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``).

    The grace period minus a margin (a tenth, 5 to 30 s), so that the launcher's
    SIGKILL comes before the kubelet's and the sidecar still has time to upload.
    The webhook writes it into the pod; the shim applies it where torch ignores the env.
    """
    margin = min(30, max(5, grace_seconds // 10))
    return max(1, grace_seconds - margin)

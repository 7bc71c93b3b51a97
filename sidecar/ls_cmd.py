"""``jitckpt ls DESTINATION``: a job's checkpoints, each valid, torn or set aside, with the reason.

Set aside: valid, but a resume from it failed twice (``sidecar/setaside.py``);
restores pass over it, and it stays in the store.

A last row, ``final``, is the trained model of the last run that finished
(``final/``, see ``sidecar/final.py``): valid, or torn with the reason, its
size, its time, and (``--json``) the address of its files.

DESTINATION is a job root: ``s3://bucket/prefix/<ns>/<job>``, or
``pvc://claim/path/<ns>/<job>`` with the claim mounted at ``--pvc-mount``,
or a plain directory (a claim mounted by hand). S3 credentials and endpoint
come from the usual env (``AWS_ACCESS_KEY_ID``, ``AWS_S3_ENDPOINT``, ...).
Exit code: 0 when at least one checkpoint is valid, 1 when none is, 2 on errors.

What a row says comes from the validity rule alone: the state, the step (from
the object keys), and kind, nodes, size and time only from a commit record
(or manifests) that ``summary.decode`` (``manifest.decode``) accepted; every
text is escaped before it reaches the terminal (``jitckpt/text.py``), so a
planted manifest or a store's error message can neither move the cursor nor
print a row of its own. Like a restore's judgement, it reads a listing of
each checkpoint's ``.jitckpt/`` and its record, whatever the number of
nodes: "valid" means committed by every node and found torn by none; each
file is verified by the node that downloads it (a torn checkpoint without a
record shows no size).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shim import layout


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("destination", help="the job root (s3://..., pvc://..., or a directory)")
    parser.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    parser.add_argument(
        "--pvc-mount",
        type=Path,
        default=Path(layout.PVC_MOUNT),
        help=f"where the claim of a pvc:// destination is mounted (default {layout.PVC_MOUNT})",
    )
    parser.add_argument(
        "--no-verify-ssl", action="store_true", help="do not check the S3 endpoint's certificate"
    )
    parser.set_defaults(func=run)


ROW = "{step:>8}  {state:<9}  {kind:<9}  {nodes:>5}  {size:>10}  {time:<25}  {reason}"
HEADER = {
    "step": "STEP",
    "state": "STATE",
    "kind": "KIND",
    "nodes": "NODES",
    "size": "SIZE",
    "time": "TIME",
    "reason": "REASON",
}


def _size(value: int) -> str:
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import sys

    from jitckpt.text import escape
    from sidecar import final
    from sidecar.config import AgentConfig
    from sidecar.setaside import scan
    from sidecar.storage.base import StoreError
    from sidecar.storage.factory import open_store
    from sidecar.uri import DestinationError, parse_job_root
    from sidecar.validity import CheckpointState

    try:
        root = parse_job_root(args.destination, args.pvc_mount)
    except DestinationError as exc:
        print(f"jitckpt ls: {exc}", file=sys.stderr)
        return 2
    config = AgentConfig(
        destination=root.uri, pvc_mount=args.pvc_mount, verify_ssl=not args.no_verify_ssl
    )

    async def collect() -> tuple[list[CheckpointState], final.FinalState | None]:
        async with open_store(config, root) as store:
            return [state async for state in scan(store)], await final.judge(store)

    try:
        states, model = asyncio.run(collect())
    except (StoreError, OSError) as exc:
        print(escape(f"jitckpt ls: cannot read {root.uri}: {exc}"), file=sys.stderr)
        return 2
    rows = [
        {
            "step": s.step,
            "state": "valid" if s.valid else "set-aside" if s.set_aside else "torn",
            "reason": s.reason,
            "kind": s.kind,
            "nodes": s.nnodes,
            "size": s.size,
            "time": s.time,
            "uri": root.child_uri(f"{layout.CHECKPOINT_PREFIX}{s.step}"),
        }
        for s in states
    ]
    final_row = None
    if model is not None:
        final_row = {
            "state": "valid" if model.valid else "torn",
            "reason": model.reason,
            "step": model.step,
            "files": len(model.files),
            "size": model.size,
            "time": model.time,
            "uri": root.child_uri(model.key),
        }
    if args.json:
        document = {"destination": root.uri, "checkpoints": rows, "final": final_row}
        print(json.dumps(document, indent=1))
    elif not rows and final_row is None:
        print(f"no checkpoints under {root.uri}")
    else:
        print(ROW.format(**HEADER))
        for state, row in zip(states, rows, strict=True):
            nodes = "-" if state.nnodes is None else str(state.nnodes)
            size = "-" if state.size is None else _size(state.size)
            print(escape(ROW.format(**{**row, "nodes": nodes, "size": size})))
        if model is not None and final_row is not None:
            shown = {"step": "final", "kind": "model", "nodes": "-", "size": _size(model.size)}
            print(escape(ROW.format(**{**final_row, **shown})))
    return 0 if any(s.valid for s in states) else 1

"""``jitckpt agent``: run the checkpoint sidecar.

Reads its settings from the environment the webhook injects (see
``sidecar/config.py``). Heavy imports happen inside ``run`` so that the
``jitckpt`` command stays quick for every other subcommand.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shim import layout


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--phase",
        choices=("all", "restore", "run"),
        default="all",
        help="all: native sidecar (default); restore: legacy init container; "
        "run: legacy container that exits once the trainer is gone",
    )
    parser.add_argument(
        "--termination-log",
        type=Path,
        default=Path("/dev/termination-log"),
        help="where the termination message goes (the pod's terminationMessagePath)",
    )
    parser.add_argument(
        "--shim-target",
        type=Path,
        default=Path(layout.SHIM_DIR),
        help="directory the shim is copied to (the trainer's PYTHONPATH entry)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import os
    import sys

    from sidecar.agent import Agent
    from sidecar.config import AgentConfig
    from sidecar.logtext import EscapingFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        EscapingFormatter(
            f"%(asctime)s %(levelname)s {layout.AGENT_CONTAINER} %(name)s: %(message)s"
        )
    )
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("aiobotocore").setLevel(logging.WARNING)
    logging.getLogger("botocore").setLevel(logging.WARNING)
    try:
        config = AgentConfig.from_env()
    except ValueError as exc:  # pydantic's ValidationError is one too
        print(f"jitckpt agent: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    agent = Agent(
        config,
        phase=args.phase,
        termination_log=args.termination_log,
        shim_target=args.shim_target,
    )
    code = asyncio.run(agent.run())
    # Everything is committed, recorded and said: leave without the interpreter's teardown
    # of every module (about 0.2 s here), the last thing between the JIT commit and the
    # pod being gone (the preempting job waits for its nodes).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

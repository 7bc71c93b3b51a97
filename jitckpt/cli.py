"""The ``jitckpt`` command: one argparse tree, each subcommand in its own module.

Every command module exposes ``configure(parser)``, which adds its arguments
and sets ``func`` (``args -> exit code``). Command modules import only the
standard library at module level so that ``jitckpt agent`` never pays for
FastAPI and ``jitckpt inject`` never pays for aiobotocore.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help). The order is the order of ``jitckpt --help``.
COMMANDS: dict[str, tuple[str, str]] = {
    "inject": ("webhook.inject_cmd", "print the injected YAML of pods or PyTorchJobs"),
    "audit": ("webhook.audit", "report which pods are injected and which have drifted"),
    "webhook": ("webhook.serve_cmd", "the admission server and its certificates"),
    "agent": ("sidecar.agent_cmd", "run the checkpoint sidecar"),
    "ls": ("sidecar.ls_cmd", "list a job's checkpoints, valid or torn"),
    "demo": ("sidecar.demo.cli", "preempt and resume a real training run, no cluster needed"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jitckpt", description="Just-in-time checkpointing for Kubeflow training jobs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).configure(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""The ``jitckpt`` command: one dispatch table, each subcommand in its own module.

This module lives outside every part (``webhook``, ``sidecar``, ``local``) so
that each image can carry it with only its own part: the sidecar image has no
``webhook`` package and the webhook image no ``sidecar``. Only the chosen
subcommand's module is imported, so ``jitckpt agent`` never imports the webhook
(or FastAPI) and ``jitckpt inject`` never imports aiobotocore.

Every command module exposes ``configure(parser)``, which adds its arguments
and sets ``func`` (``args -> exit code``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

# name -> (module, one-line help). The order is the order of ``jitckpt --help``.
COMMANDS: dict[str, tuple[str, str]] = {
    "inject": ("webhook.inject_cmd", "print the injected YAML of pods or PyTorchJobs"),
    "audit": ("webhook.audit", "report which pods are injected and which have drifted"),
    "webhook": ("webhook.serve_cmd", "the admission server and its certificates"),
    "agent": ("sidecar.agent_cmd", "run the checkpoint sidecar"),
    "ls": ("sidecar.ls_cmd", "list a job's checkpoints, valid or torn"),
    "demo": ("local.demo.cli", "preempt and resume a real training run, no cluster needed"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (none for ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="jitckpt", description="Just-in-time checkpointing for Kubeflow training jobs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        subparser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            _load(name, module).configure(subparser)
    return parser


def _load(name: str, module: str) -> ModuleType:
    """The subcommand's module; exits with a message when its part is not installed.

    Each image carries its own part only (``jitckpt inject`` has no ``webhook``
    package in the sidecar image), and each part's dependencies are its extra.
    """
    part = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if not exc.name or "." in exc.name:
            raise  # a package is there but lacks a module: a broken install, not a missing part
        needs = f"jitckpt's {part} part" if exc.name == part else f"the package {exc.name!r}"
        sys.exit(
            f"jitckpt {name}: needs {needs}, which this installation lacks "
            f"(each image carries only its own part; elsewhere: pip install 'jitckpt[{part}]')"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in args_list if not arg.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(args_list)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""``jitckpt inject``: print the injected YAML of pods, lists and PyTorchJobs.

Reads one file or stdin (``-f -``) so ``cat ns.yaml pod.yaml | jitckpt inject
-f -`` works: Namespace documents in the input (or ``--namespace-file``) give
the namespaces' settings. Output: the same documents in order. Skips and
warnings go to stderr; an invalid setting makes the exit code 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_INVALID_SETTING = 1
EXIT_BAD_INPUT = 2


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f", "--filename", required=True, help="YAML with Pods, Lists or PyTorchJobs ('-': stdin)"
    )
    parser.add_argument("--config", type=Path, help="the webhook's config file (cluster defaults)")
    parser.add_argument(
        "--namespace-file",
        type=Path,
        action="append",
        default=[],
        help="YAML with Namespace documents whose labels and annotations apply (repeatable)",
    )
    parser.add_argument(
        "-n", "--namespace", default="default", help="namespace of objects that name none"
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = settings_help()
    parser.set_defaults(func=run)


def settings_help() -> str:
    """The settings a user can write, for ``--help`` (``webhook.settings`` is stdlib-only)."""
    from webhook import settings

    lines = [
        f"opt in: namespace label {settings.INJECTION_LABEL}={settings.INJECTION_ENABLED} "
        "(not needed here); opt out: pod label or annotation "
        f"{settings.INJECT_KEY}=false",
        "settings (pod annotation > namespace annotation > config defaults > built-in):",
    ]
    for setting in settings.SETTINGS.values():
        default = setting.default if setting.default is not None else "unset"
        lines.append(f"  {setting.key} (default {default}): {setting.help}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from webhook.documents import (
        WITHOUT_CONFIG,
        InputError,
        dump_documents,
        read_command_input,
    )
    from webhook.offline import OfflineInjector

    try:
        given = read_command_input(args.filename, args.config, args.namespace_file)
    except InputError as exc:
        print(f"jitckpt inject: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    config, docs, known = given.config, given.docs, given.namespaces
    if args.config is None:
        print(f"jitckpt inject: {WITHOUT_CONFIG}", file=sys.stderr)
    injector = OfflineInjector(config, known, args.namespace)
    out = [injector.document(doc) for doc in docs]
    for line in injector.outcome.lines:
        print(line, file=sys.stderr)
    sys.stdout.write(dump_documents(out))
    return EXIT_INVALID_SETTING if injector.outcome.invalid else 0

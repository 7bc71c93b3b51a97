"""``jitckpt demo``: preempt and resume a real training run on this machine, no cluster.

With no arguments: the bundled tiny HF Trainer script on two nodes, an
embedded S3 server, SIGTERM mid-run, resume, and a bitwise comparison with a
run never interrupted. ``--script`` runs your own, unchanged script instead
(it becomes the trainer container's ``torchrun`` command in generated
PyTorchJob pods, or TrainJob ``node`` pods with ``--kind trainjob``); a shell
script (``.sh``) is the command itself, run by bash, and starts torchrun as
the ``bash -c`` line of a Kubeflow SDK ``CustomTrainer(func=...)`` does.
Only the standard library is imported here; the run itself imports the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--script",
        type=Path,
        help="your training script, run by torchrun (default: bundled); a .sh script is the "
        "trainer's command itself, run by bash (it starts torchrun, as a Kubeflow SDK "
        "function's bash -c line does)",
    )
    parser.add_argument("--nnodes", type=int, default=2, help="pods, one per node (default 2)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes per pod")
    parser.add_argument(
        "--kind",
        choices=("pytorchjob", "trainjob"),
        default="pytorchjob",
        help="the pods of a PyTorchJob (training-operator v1) or of a TrainJob (Trainer v2)",
    )
    parser.add_argument(
        "--preempt-at-step",
        type=int,
        default=12,
        help="SIGTERM at this step (the demo's pods hold there until it arrives)",
    )
    parser.add_argument(
        "--preempt-nodes",
        choices=("all", "one"),
        default="all",
        help="preempt every pod, or only the last node's pod",
    )
    parser.add_argument(
        "--resume-nnodes",
        type=int,
        help="re-create the job with this many pods after the preemption (default: --nnodes); "
        "a sharded plain loop resumes resharded, with no bitwise comparison",
    )
    parser.add_argument(
        "--destination",
        help="s3://bucket/prefix (AWS_* env) or pvc://claim/path (default: embedded S3)",
    )
    parser.add_argument("--grace-period", type=int, default=60, help="seconds (default 60)")
    parser.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="after a resumed run whose trainer failed, start the job's pods again, as its "
        "restart policy would, at most this many times (default 0)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also run uninterrupted and compare the final weights bitwise (always on without "
        "--script; the shim captures the weights, the script needs nothing for it)",
    )
    parser.add_argument("--sidecar-mode", choices=("native", "legacy"), default="native")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another jitckpt.io/KEY setting on the namespace, e.g. --set save-steps=5",
    )
    parser.add_argument(
        "--sidecar-image",
        type=Path,
        metavar="EXPORT",
        help="run the sidecar from this built image, as its user on a read-only root "
        "(an export of `make images-check`: build/images/sidecar)",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="run on a real control plane instead (kube-apiserver, its controllers, Kueue, "
        "the training-operator, the Trainer with JobSet, the webhook from deploy/): Kueue "
        "preempts a PyTorchJob (or with --kind trainjob a TrainJob) of the bundled script and "
        "admits it again; takes only --kind, --json, --workdir and --keep (needs `make "
        "controlplane`)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON summary on stdout")
    parser.add_argument(
        "--logs", action="store_true", help="stream every container's log to stderr"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory and logs")
    parser.add_argument("--workdir", type=Path, help="where pods, volumes and logs go")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="after --: arguments for your script"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from local.demo.jobpods import KINDS
    from local.demo.jobrun import JobError
    from local.demo.scenario import DemoOptions, run_demo
    from local.podrunner import SpecError

    if args.cluster:
        from local.clusterdemo.run import run_cluster_demo

        if args.script is not None or args.script_args or args.destination:
            print("jitckpt demo: --cluster runs the bundled script only", file=sys.stderr)
            return 2
        return run_cluster_demo(args.workdir, args.keep, args.json, args.kind)
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    if args.script is None and script_args:
        print("jitckpt demo: script arguments need --script", file=sys.stderr)
        return 2
    if min(args.nnodes, args.nproc_per_node, args.preempt_at_step, args.resume_nnodes or 1) < 1:
        print(
            "jitckpt demo: --nnodes, --resume-nnodes, --nproc-per-node and --preempt-at-step "
            "must be >= 1",
            file=sys.stderr,
        )
        return 2
    settings = dict(item.split("=", 1) for item in args.set if "=" in item)
    if len(settings) != len(args.set):
        print("jitckpt demo: --set takes KEY=VALUE", file=sys.stderr)
        return 2
    options = DemoOptions(
        script=args.script.resolve() if args.script else None,
        script_args=script_args,
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        preempt_at_step=args.preempt_at_step,
        preempt_nodes=args.preempt_nodes,
        kind={kind.lower(): kind for kind in KINDS}[args.kind],
        destination=args.destination,
        grace_period=args.grace_period,
        restarts=max(0, args.restarts),
        resume_nnodes=args.resume_nnodes,
        compare=args.compare or args.script is None,
        sidecar_mode=args.sidecar_mode,
        workdir=args.workdir,
        keep=args.keep,
        stream_logs=args.logs,
        settings=settings,
        sidecar_image=args.sidecar_image,
    )
    account = sys.stderr if args.json else sys.stdout
    try:
        summary = run_demo(options, account)
    except (JobError, SpecError, ValueError, OSError) as exc:
        print(f"jitckpt demo: {exc}", file=account)
        summary = {"ok": False, "error": str(exc)}
    if args.json:
        sys.stdout.write(json.dumps(summary) + "\n")
    return 0 if summary["ok"] else 1

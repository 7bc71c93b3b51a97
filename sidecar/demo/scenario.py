"""The demo's story: run, preempt at step K, resume, compare with a run never preempted.

Every pod is a PyTorchJob pod as the training-operator creates it, injected by
``mutate()`` and run by the pod runner. The summary it returns is the
``--json`` document; ``ok`` is true only when every part of it says success.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from sidecar.demo.destination import Destination
from sidecar.demo.jobpods import JobSpec
from sidecar.demo.jobrun import AGENT, TRAINER, JobRun
from sidecar.demo.narrate import Narrator
from sidecar.demo.s3server import free_port
from sidecar.demo.watch import CommitWatcher
from sidecar.demo.weights import compare_files
from sidecar.podrunner import Node, ObjectStore
from webhook.config import WebhookConfig
from webhook.injection import job_root
from webhook.mutate import NamespaceInfo

BUNDLED_SCRIPT = Path(__file__).with_name("train_tiny.py")
NAMESPACE = "jitckpt-demo"
JIT_EXIT_CODE = 143
# What the "image" brings: offline HF, one BLAS thread per process on a small machine.
IMAGE_ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class DemoOptions:
    script: Path | None = None  # None: the bundled tiny HF Trainer script
    script_args: list[str] = field(default_factory=list)
    nnodes: int = 2
    nproc_per_node: int = 1
    preempt_at_step: int = 12
    preempt_nodes: str = "all"  # "all" or "one" (the last node)
    destination: str | None = None  # None: the embedded S3 server
    grace_period: int = 60
    compare: bool = True
    sidecar_mode: str = "native"
    max_steps: int = 30  # bundled script only
    step_sleep: float = 0.15  # bundled script only, first run: time to preempt mid-run
    job_name: str = "tiny"
    workdir: Path | None = None
    keep: bool = False
    stream_logs: bool = False
    timeout: float = 300.0


@dataclass
class Scenario:
    options: DemoOptions
    narrator: Narrator
    workdir: Path
    node: Node
    destination: Destination
    log_stream: IO[str] | None = None

    @property
    def bundled(self) -> bool:
        return self.options.script is None

    def command(self, run: str, *, final_weights: Path | None, slow: bool) -> list[str]:
        script = self.options.script or BUNDLED_SCRIPT
        args = list(self.options.script_args)
        if self.bundled:
            args += ["--output-dir", str(self.workdir / "output" / run)]
            args += ["--max-steps", str(self.options.max_steps)]
            if slow:
                args += ["--step-sleep", str(self.options.step_sleep)]
        if final_weights is not None:
            args += ["--final-weights", str(final_weights)]
        return ["torchrun", str(script), *args]

    def job(self, name: str, command: list[str]) -> JobSpec:
        return JobSpec(
            name=name,
            namespace=NAMESPACE,
            nnodes=self.options.nnodes,
            nproc_per_node=self.options.nproc_per_node,
            command=command,
            master_port=free_port(),
        )

    def namespace(self) -> NamespaceInfo:
        annotations = {
            **self.destination.namespace_annotations(),
            "jitckpt.io/grace-period-seconds": str(self.options.grace_period),
            "jitckpt.io/sidecar-mode": self.options.sidecar_mode,
        }
        return NamespaceInfo(NAMESPACE, {"jitckpt.io/injection": "enabled"}, annotations)

    def run(self, job: JobSpec, inject: bool = True) -> JobRun:
        return JobRun(
            self.node,
            job,
            self.namespace(),
            WebhookConfig(),
            inject=inject,
            on_event=self.narrator.pod_event,
            on_status=self.narrator.status,
        )


def _termination_doc(message: str) -> dict[str, Any]:
    try:
        doc = json.loads(message)
    except ValueError:
        return {"message": message}
    return doc if isinstance(doc, dict) else {"message": message}


def _same(values: list[Any]) -> Any:
    return values[0] if values and all(v == values[0] for v in values) else None


def run_demo(options: DemoOptions, account: IO[str]) -> dict[str, Any]:
    """Run the whole story; ``account`` gets the running narration."""
    narrator = Narrator(account)
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="jitckpt-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    destination = (
        Destination.from_uri(options.destination) if options.destination else Destination.embedded()
    )
    node = Node(
        root=workdir / "node",
        objects=ObjectStore(secrets=destination.secrets()),
        image_env=IMAGE_ENV,
        stream=sys.stderr if options.stream_logs else None,
    )
    scenario = Scenario(options, narrator, workdir, node, destination)
    try:
        summary = _story(scenario)
    finally:
        destination.close()
    summary["workdir"] = str(workdir)
    if summary["ok"] and not options.keep:
        shutil.rmtree(workdir, ignore_errors=True)
        summary["workdir"] = None
    return summary


def _story(s: Scenario) -> dict[str, Any]:
    o, say = s.options, s.narrator.say
    script = o.script or BUNDLED_SCRIPT
    say(
        f"jitckpt demo: {o.nnodes} node(s) x {o.nproc_per_node} process(es) running "
        f"`torchrun {script.name}`, checkpoints to {s.destination.description}"
    )
    started = time.monotonic()
    reference_weights = s.workdir / "weights-uninterrupted.pt"
    resumed_weights = s.workdir / "weights-resumed.pt"

    reference: JobRun | None = None
    if o.compare:
        say(f"uninterrupted run (job {o.job_name}-reference, no injection): starting")
        reference = s.run(
            s.job(
                f"{o.job_name}-reference",
                s.command("reference", final_weights=reference_weights, slow=False),
            ),
            inject=False,
        ).start()
        reference.wait(o.timeout)
        say(f"uninterrupted run finished: trainer exit codes {reference.exit_codes()}")

    # Run 1: injected, preempted at step K.
    job = s.job(o.job_name, s.command("run-1", final_weights=None, slow=True))
    first = s.run(job)
    root = job_root(s.destination.uri, NAMESPACE, o.job_name)
    watcher = CommitWatcher(lambda: s.destination.open_store(root, s.node), interval=0.1).start()
    first.start()
    mutation = first.mutations[0]
    say(f"webhook: {mutation.message}")
    pod0 = mutation.pod["spec"]
    say(
        f"  grace period {pod0['terminationGracePeriodSeconds']} s, trainer env "
        + ", ".join(_trainer_env_names(pod0))
    )
    for warning in mutation.warnings:
        say(f"  warning: {warning}")
    first.wait_for_step(o.preempt_at_step, o.timeout)
    ranks = None if o.preempt_nodes == "all" else [o.nnodes - 1]
    targets = [p.name for p in first.pods] if ranks is None else [first.pods[-1].name]
    first.preempt(ranks)
    say(
        f"step {first.preempted_at_step} reached: preempting {', '.join(targets)} "
        f"(preStop hook, then SIGTERM; grace period {first.pods[0].grace_seconds:g} s)"
    )
    first.wait(o.grace_period + 60)
    watcher.stop()
    assert first.sigterm_at is not None and first.finished_at is not None
    docs = [_termination_doc(m) for m in first.messages(AGENT)]
    jit_steps = [
        (d.get("last_committed") or {}).get("step")
        for d in docs
        if (d.get("last_committed") or {}).get("kind") == "jit"
    ]
    jit_step = _same(jit_steps) if len(jit_steps) == len(docs) else None
    committed_at = watcher.valid_at.get(jit_step) if jit_step is not None else None
    committed = committed_at is not None
    sigterm_to_committed = (
        round(committed_at - first.sigterm_at, 2) if committed_at is not None else None
    )
    trainer_codes = first.exit_codes()
    say(
        f"pods gone {first.finished_at - first.sigterm_at:.1f} s after SIGTERM; "
        f"trainer exit codes {trainer_codes}"
    )
    if any(c != JIT_EXIT_CODE for c in trainer_codes):
        say(
            f"  (the training processes exit {JIT_EXIT_CODE}; a container's code is that of its "
            "PID 1, here torchrun, which turns its workers' exit into its own)"
        )
    for pod, doc in zip(first.pods, docs, strict=True):
        say(f"  {pod.name} termination message: {doc.get('message', '')}")
    if committed:
        say(
            f"checkpoint-{jit_step} is valid in the store, committed "
            f"{sigterm_to_committed:.2f} s after SIGTERM"
        )
    else:
        say(f"no JIT checkpoint is valid in the store (torn: {watcher.torn or 'none'})")

    # Run 2: new pods of the same job resume.
    s.narrator.new_run()
    say(f"run 2: new pods for job {o.job_name} (fresh local volumes); the sidecars restore first")
    second = s.run(
        s.job(
            o.job_name,
            s.command("run-2", final_weights=resumed_weights if o.compare else None, slow=False),
        )
    ).start()
    second.wait(o.timeout)
    docs2 = [_termination_doc(m) for m in second.messages(AGENT)]
    resumed_from = _same([d.get("restored_step") for d in docs2])
    final_codes = second.exit_codes()
    final_step = _final_step(second) if s.bundled else (second.step or None)
    say(f"run 2 finished: resumed from step {resumed_from}, trainer exit codes {final_codes}")

    equal: bool | None = None
    if o.compare:
        if resumed_weights.exists() and reference_weights.exists():
            comparison = compare_files(resumed_weights, reference_weights)
            equal = comparison.equal
            detail = (
                f"all {comparison.tensors} tensors bitwise equal"
                if equal
                else f"{len(comparison.differing)} of {comparison.tensors} tensors differ"
            )
        else:
            equal, detail = False, "a final weights file is missing"
        say(f"final weights, resumed vs uninterrupted: {detail}")

    checks = {
        "jit checkpoint committed": committed,
        # After a JIT save no trainer may look successful (the shim's workers exit 143;
        # the container's code is torchrun's, which reports its workers' failure).
        "no trainer reported success after the JIT save": all(
            c not in (0, None) for c in trainer_codes
        ),
        "jit step >= preemption step": jit_step is not None
        and jit_step >= (first.preempted_at_step or 0),
        "resumed from the jit checkpoint": resumed_from is not None and resumed_from == jit_step,
        "resumed run finished": all(c == 0 for c in final_codes)
        and (not s.bundled or final_step == o.max_steps),
        "equal to uninterrupted": equal is not False,
    }
    ok = all(checks.values())
    failed = [name for name, passed in checks.items() if not passed]
    say(
        "verdict: OK, preempted, saved just in time, resumed, same result"
        if ok
        else f"verdict: FAILED ({'; '.join(failed)}); logs in {s.workdir / 'node' / 'pods'}"
    )
    say(f"total {time.monotonic() - started:.1f} s")
    return {
        "ok": ok,
        "nnodes": o.nnodes,
        "nproc_per_node": o.nproc_per_node,
        "sidecar_mode": o.sidecar_mode,
        "preempt_nodes": o.preempt_nodes,
        "preempted_at_step": first.preempted_at_step,
        "jit_checkpoint_step": jit_step,
        "committed": committed,
        "sigterm_to_committed_s": sigterm_to_committed,
        "trainer_exit_codes": trainer_codes,
        "resumed_from_step": resumed_from,
        "final_step": final_step,
        "final_exit_codes": final_codes,
        "equal_to_uninterrupted": equal,
        "destination": root,
        "termination_messages": [d.get("message") for d in docs],
        "failed_checks": failed,
        "seconds": round(time.monotonic() - started, 1),
    }


def _final_step(run: JobRun) -> int | None:
    """The step the bundled script says ``train()`` returned at (rank 0's log)."""
    log = run.results[0].containers[TRAINER].log_path if run.results else None
    if log is None or not log.exists():
        return None
    found = re.findall(rb"train\(\) returned at step (\d+)", log.read_bytes())
    return int(found[-1]) if found else None


def _trainer_env_names(spec: dict[str, Any]) -> list[str]:
    container = spec["containers"][0]
    return [
        e["name"]
        for e in container.get("env", [])
        if e["name"].startswith(("JITCKPT", "PYTHONPATH", "TORCH"))
    ]

"""The demo's story: run, preempt at step K, resume, compare with a run never preempted.

Every pod is a PyTorchJob pod as the training-operator creates it (or a
TrainJob ``node`` pod as Trainer v2 and JobSet create it), injected by
``mutate()`` and run by the pod runner. The summary it returns is the
``--json`` document; ``ok`` is true only when every part of it says success.

Two env vars go into the trainer container of the demo's own pods, as a
user's env would (the webhook never sets them); the shim reads them:

- run 1 gets ``JITCKPT_DEMO_HOLD_AT_STEP=K``: its ranks hold at step K until
  the SIGTERM arrives, so the JIT checkpoint is at K however fast the script
  trains. Only the timing differs from production, never what is saved.
- with ``--compare``, the resumed run and the uninterrupted one (a job of its
  own name, injected too, never preempted) get ``JITCKPT_DEMO_FINAL_WEIGHTS``:
  rank 0's shim writes the trained model's state dict there at the normal end
  of training, so the script needs no flag for it: the weights of the last
  step, taken before a best-model load (HF's ``load_best_model_at_end`` would
  otherwise hand over a checkpoint's from before the preemption), and beside
  them the trainer's log history where the framework keeps one (HF's).

``--compare`` then judges what the shim captured (those weights and that log:
every loss, gradient norm and evaluation logged, ``loghistory``) and what the
script itself saved at its end, as each job's sidecar uploaded it to
``final/`` (``saved``): a resumed run whose best checkpoint or weights match
but whose logged losses, saved EMA, tracker or counter do not is not "the
same result".
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from local.demo.destination import Destination
from local.demo.jobpods import JobSpec
from local.demo.jobrun import JobRun, termination_doc
from local.demo.loghistory import LogComparison, compare_logs
from local.demo.loghistory import read as read_log
from local.demo.narrate import Narrator, downloaded
from local.demo.saved import SavedComparison, compare_runs
from local.demo.watch import CommitWatcher
from local.demo.weights import compare_files
from local.podrunner import ImageRoot, Node, ObjectStore
from local.ports import free_port
from shim.layout import (
    ENV_DEMO_FINAL_WEIGHTS,
    ENV_DEMO_HOLD_AT_STEP,
    JIT_EXIT_CODE,
    demo_log_path,
)
from webhook.config import WebhookConfig
from webhook.injection import job_root
from webhook.jobs import PYTORCHJOB
from webhook.mutate import NamespaceInfo
from webhook.status import AGENT

BUNDLED_SCRIPT = Path(__file__).with_name("train_tiny.py")
NAMESPACE = "jitckpt-demo"
# What the "image" brings: offline HF, one BLAS thread per process on a small machine.
IMAGE_ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def image_env() -> dict[str, str]:
    """The image's env for every pod of one demo, both runs: one ``PYTHONHASHSEED`` for all.

    Python randomizes ``str`` hashes per process, so a set's order differs between two
    processes (PEFT writes a LoRA adapter's ``target_modules`` from a set): two
    uninterrupted runs would save different files half the time, and the comparison of
    what the script saved would blame the resume. A new seed for each demo, shared by
    its pods, keeps that comparison about the resume alone.
    """
    return {**IMAGE_ENV, "PYTHONHASHSEED": str(random.SystemRandom().randrange(1, 2**32))}


def launcher(script: Path) -> str:
    """What runs ``script`` in the trainer container: bash for a shell script, else torchrun."""
    return "bash" if script.suffix == ".sh" else "torchrun"


@dataclass
class DemoOptions:
    script: Path | None = None  # None: the bundled tiny HF Trainer script
    script_args: list[str] = field(default_factory=list)
    nnodes: int = 2
    nproc_per_node: int = 1
    preempt_at_step: int = 12
    preempt_nodes: str = "all"  # "all" or "one" (the last node)
    kind: str = PYTORCHJOB  # or TRAINJOB: the pods of that kind of Kubeflow job
    destination: str | None = None  # None: the embedded S3 server
    grace_period: int = 60
    compare: bool = True
    sidecar_mode: str = "native"
    max_steps: int = 30  # bundled script only
    # Its own name per demo: a destination that outlives the demo (the user's
    # bucket) must not hand an earlier demo's checkpoints to this one.
    job_name: str = field(default_factory=lambda: f"demo-{secrets.token_hex(3)}")
    workdir: Path | None = None
    keep: bool = False
    stream_logs: bool = False
    timeout: float = 300.0
    settings: dict[str, str] = field(default_factory=dict)  # more jitckpt.io/* for the namespace
    reference_weights: Path | None = None  # an uninterrupted run's weights, to skip that run
    # An exported sidecar image (`make images-check`): its containers run from its
    # root instead of this interpreter (local/podrunner/image.py).
    sidecar_image: Path | None = None
    # After a resumed run whose trainer failed: new pods for the job, as a controller's
    # restart policy would start, at most this many times.
    restarts: int = 0
    # The job re-created with this many nodes after the preemption (Kueue admits it
    # smaller, the user edits nnodes); None: as many as before.
    resume_nnodes: int | None = None

    @property
    def resharded(self) -> bool:
        """The resumed runs have another number of nodes: no bitwise comparison is owed."""
        return self.resume_nnodes is not None and self.resume_nnodes != self.nnodes


@dataclass
class Scenario:
    options: DemoOptions
    narrator: Narrator
    workdir: Path
    node: Node
    destination: Destination
    runs: list[JobRun] = field(default_factory=list)
    watchers: list[CommitWatcher] = field(default_factory=list)

    @property
    def bundled(self) -> bool:
        return self.options.script is None

    def command(self, run: str) -> list[str]:
        """The trainer container's command: torchrun reads the node layout from PET_* env.

        A shell script (``.sh``) is the command itself, run by bash: it starts torchrun as
        it likes, as the ``bash -c`` line of a Kubeflow SDK ``CustomTrainer(func=...)``
        writes the function to a new temporary file and runs it at every pod start.
        """
        script = self.options.script or BUNDLED_SCRIPT
        args = list(self.options.script_args)
        if self.bundled:
            args += ["--output-dir", str(self.workdir / "output" / run)]
            args += ["--max-steps", str(self.options.max_steps)]
        return [launcher(script), str(script), *args]

    @property
    def reference_name(self) -> str:
        return f"{self.options.job_name}-reference"

    def job(self, run: str, name: str, env: dict[str, str], nnodes: int | None = None) -> JobSpec:
        """Job ``name`` for ``run`` (on ``nnodes`` nodes, else the job's); each of its pods
        starts in a working directory of its own."""
        o = self.options
        nnodes = nnodes or o.nnodes
        dirs = [self.workdir / "work" / run / f"node-{rank}" for rank in range(nnodes)]
        for directory in dirs:
            directory.mkdir(parents=True, exist_ok=True)
        return JobSpec(
            name=name,
            namespace=NAMESPACE,
            nnodes=nnodes,
            nproc_per_node=o.nproc_per_node,
            command=self.command(run),
            master_port=free_port(),
            kind=o.kind,
            env=env,
            working_dirs=[str(d) for d in dirs],
        )

    @property
    def job_root(self) -> str:
        return job_root(self.destination.uri, NAMESPACE, self.options.job_name)

    def namespace(self) -> NamespaceInfo:
        annotations = {
            **self.destination.namespace_annotations(),
            "jitckpt.io/grace-period-seconds": str(self.options.grace_period),
            "jitckpt.io/sidecar-mode": self.options.sidecar_mode,
            **{f"jitckpt.io/{k}": v for k, v in self.options.settings.items()},
        }
        return NamespaceInfo(NAMESPACE, {"jitckpt.io/injection": "enabled"}, annotations)

    def run(self, job: JobSpec, narrate_status: bool = True) -> JobRun:
        """Job ``job``'s pods, injected; its sidecars' status narrated unless told otherwise."""
        run = JobRun(
            self.node,
            job,
            self.namespace(),
            WebhookConfig(),
            on_event=self.narrator.pod_event,
            on_status=self.narrator.status if narrate_status else None,
        )
        self.runs.append(run)
        return run

    def kill_leftovers(self) -> None:
        """After a failure half-way: no pod or store watcher of this scenario outlives it."""
        for run in self.runs:
            for pod in run.pods:
                if not pod.done:
                    pod.kill()
        for watcher in self.watchers:
            watcher.stop()


def _same(values: list[Any]) -> Any:
    return values[0] if values and all(v == values[0] for v in values) else None


def run_demo(options: DemoOptions, account: IO[str]) -> dict[str, Any]:
    """Run the whole story; ``account`` gets the running narration."""
    with open_scenario(options, account) as scenario:
        summary = story(scenario)
    summary["workdir"] = str(scenario.workdir)
    if summary["ok"] and not options.keep:
        shutil.rmtree(scenario.workdir, ignore_errors=True)
        summary["workdir"] = None
    return summary


@contextlib.contextmanager
def open_scenario(options: DemoOptions, account: IO[str]) -> Iterator[Scenario]:
    """A node, a destination and a narrator for ``options``; the S3 server stops after."""
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="jitckpt-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    destination = (
        Destination.from_uri(options.destination) if options.destination else Destination.embedded()
    )
    try:
        image_roots = {}
        if options.sidecar_image is not None:
            image_roots[WebhookConfig().sidecar_image] = ImageRoot.load(options.sidecar_image)
        node = Node(
            root=workdir / "node",
            objects=ObjectStore(secrets=destination.secrets()),
            image_env=image_env(),
            image_roots=image_roots,
            stream=sys.stderr if options.stream_logs else None,
        )
        scenario = Scenario(options, Narrator(account), workdir, node, destination)
        try:
            yield scenario
        finally:
            scenario.kill_leftovers()
    finally:
        destination.close()


@dataclass
class FirstRun:
    """Run 1, preempted: what the sidecars and the store say about the JIT checkpoint."""

    run: JobRun
    watcher: CommitWatcher
    docs: list[dict[str, Any]]  # the sidecars' termination messages
    jit_step: int | None
    committed_at: float | None

    @property
    def sigterm_to_committed(self) -> float | None:
        if self.committed_at is None or self.run.sigterm_at is None:
            return None
        return round(self.committed_at - self.run.sigterm_at, 2)


def start_reference(s: Scenario, weights: Path) -> JobRun:
    """The same job never preempted: what resuming must reproduce.

    It is injected like the others (the shim writes its final weights), under a
    name of its own: its own job root, port and pods, so it runs alongside the
    preempted job and restores nothing of it."""
    name = s.reference_name
    s.narrator.say(f"uninterrupted run (job {name}, never preempted): starting")
    job = s.job("reference", name, {ENV_DEMO_FINAL_WEIGHTS: str(weights)})
    return s.run(job, narrate_status=False).start()  # its progress would read as run 1's


def finish_reference(s: Scenario, reference: JobRun) -> JobRun:
    reference.wait(s.options.timeout)
    s.narrator.say(f"uninterrupted run finished: trainer exit codes {reference.exit_codes()}")
    return reference


def reference_run(s: Scenario, weights: Path) -> JobRun:
    return finish_reference(s, start_reference(s, weights))


def start_first(s: Scenario) -> tuple[JobRun, CommitWatcher]:
    """Start run 1 (injected) with a watcher on the store; say what was injected."""
    o, say = s.options, s.narrator.say
    hold = {ENV_DEMO_HOLD_AT_STEP: str(o.preempt_at_step)}
    first = s.run(s.job("run-1", o.job_name, hold))
    watcher = CommitWatcher(lambda: s.destination.open_store(s.job_root, s.node), 0.1).start()
    s.watchers.append(watcher)
    first.start()
    mutation = first.mutations[0]
    say(f"webhook: {mutation.message}")
    spec = mutation.pod["spec"]
    say(
        f"  grace period {spec['terminationGracePeriodSeconds']} s, trainer env "
        + ", ".join(_trainer_env_names(spec))
    )
    for warning in mutation.warnings:
        say(f"  warning: {warning}")
    return first, watcher


def preempt(s: Scenario, first: JobRun) -> None:
    """SIGTERM (through preStop and the kubelet's path) to all pods or to the last one."""
    o = s.options
    ranks = None if o.preempt_nodes == "all" else [o.nnodes - 1]
    targets = [p.name for p in first.pods] if ranks is None else [first.pods[-1].name]
    first.preempt(ranks)
    s.narrator.say(
        f"step {first.preempted_at_step} reached (the demo's pods hold there until SIGTERM): "
        f"preempting {', '.join(targets)} (preStop hook, then SIGTERM; grace period "
        f"{first.pods[0].grace_seconds:g} s)"
    )


def finish_first(s: Scenario, first: JobRun, watcher: CommitWatcher) -> FirstRun:
    """Wait for run 1's pods to be gone and judge its JIT checkpoint."""
    say = s.narrator.say
    first.wait(s.options.grace_period + 60)
    watcher.stop()
    assert first.sigterm_at is not None and first.finished_at is not None
    docs = [termination_doc(m) for m in first.messages()]
    jit_steps = [
        (d.get("last_committed") or {}).get("step")
        for d in docs
        if (d.get("last_committed") or {}).get("kind") == "jit"
    ]
    jit_step = _same(jit_steps) if len(jit_steps) == len(docs) else None
    committed_at = watcher.valid_at.get(jit_step) if jit_step is not None else None
    result = FirstRun(first, watcher, docs, jit_step, committed_at)
    codes = first.exit_codes()
    say(
        f"pods gone {first.finished_at - first.sigterm_at:.1f} s after SIGTERM; "
        f"trainer exit codes {codes}"
    )
    if any(c != JIT_EXIT_CODE for c in codes):
        say(
            f"  (expected {JIT_EXIT_CODE} from every trainer: terminated by SIGTERM, which the "
            "training operator's restartPolicy ExitCode retries)"
        )
    for pod, doc in zip(first.pods, docs, strict=True):
        say(f"  {pod.name} termination message: {doc.get('message', '')}")
    if result.sigterm_to_committed is not None:
        say(
            f"checkpoint-{jit_step} is valid in the store, committed "
            f"{result.sigterm_to_committed:.2f} s after SIGTERM"
        )
    else:
        say(f"no JIT checkpoint is valid in the store (torn: {watcher.torn or 'none'})")
    return result


def resume(s: Scenario, final_weights: Path | None, number: int = 2) -> JobRun:
    """Run ``number`` (2 on): new pods of the same job, restored by their sidecars first."""
    o = s.options
    nnodes = o.resume_nnodes or o.nnodes
    s.narrator.new_run()
    s.narrator.say(
        f"run {number}: new pods for job {o.job_name} on {nnodes} node(s) (fresh local "
        "volumes); the sidecars restore first"
    )
    env = {ENV_DEMO_FINAL_WEIGHTS: str(final_weights)} if final_weights is not None else {}
    run = s.run(s.job(f"run-{number}", o.job_name, env, nnodes)).start()
    run.wait(o.timeout)
    return run


@dataclass
class ResumedRun:
    """One run after the preemption: what it restored, how its trainers ended."""

    number: int
    run: JobRun
    docs: list[dict[str, Any]]  # the sidecars' termination messages

    @property
    def restored(self) -> int | None:
        return resumed_from(self.run)

    def failures(self) -> list[str]:
        """Which trainers exited with an error, and at which step (the last their sidecar
        heard of), each said the way the verdict says it."""
        said = []
        for pod, code, doc in zip(self.run.pods, self.run.exit_codes(), self.docs, strict=True):
            if code == 0:
                continue
            step, restored = doc.get("last_step"), doc.get("restored_step")
            where = f"at step {step}" if isinstance(step, int) else "before its first step"
            start = f"resumed from step {restored}" if isinstance(restored, int) else "fresh"
            said.append(
                f"run {self.number}: the trainer of {pod.name} exited with code {code} {where} "
                f"({start})"
            )
        return said

    def set_aside(self) -> list[dict[str, Any]]:
        marks = [d.get("set_aside") for d in self.docs]
        return [m for m in marks if isinstance(m, dict)]

    def downloaded(self) -> dict[str, int | None]:
        """Bytes each pod's sidecar fetched from the store to restore (its termination
        message, from its status document): 0 when it used the copy on its own volume."""
        return {
            pod.name: doc.get("downloaded_bytes")
            for pod, doc in zip(self.run.pods, self.docs, strict=True)
        }

    def summary(self) -> dict[str, Any]:
        return {
            "run": self.number,
            "restored_step": self.restored,
            "downloaded_bytes": self.downloaded(),
            "exit_codes": self.run.exit_codes(),
            "failures": self.failures(),
            "set_aside": self.set_aside(),
            "trainer_logs": self.run.logs(),
            "sidecar_logs": self.run.logs(AGENT),
        }


def resumed_runs(s: Scenario, final_weights: Path | None) -> list[ResumedRun]:
    """Run 2, and after a run whose trainer failed, the restarts ``--restarts`` allows."""
    runs: list[ResumedRun] = []
    while True:
        number = len(runs) + 2
        run = resume(s, final_weights, number)
        resumed = ResumedRun(number, run, [termination_doc(m) for m in run.messages()])
        runs.append(resumed)
        for pod, size in resumed.downloaded().items():
            s.narrator.say(f"run {number}: {pod} restored with {downloaded(size)}")
        for line in resumed.failures():
            s.narrator.say(line)
        for mark in resumed.set_aside():
            s.narrator.say(f"checkpoint-{mark.get('step')} set aside: {mark.get('reason')}")
        if not resumed.failures() or len(runs) > s.options.restarts:
            return runs
        s.narrator.say(
            f"restarting the job's pods, as its restart policy would "
            f"(restart {len(runs)} of at most {s.options.restarts})"
        )


def resumed_from(second: JobRun) -> int | None:
    """The step every sidecar of a resumed run restored (None: none, or they disagree)."""
    docs = [termination_doc(m) for m in second.messages()]
    step = _same([d.get("restored_step") for d in docs])
    return step if isinstance(step, int) else None


def reported_last_step(run: JobRun) -> int | None:
    """The step every trainer's final progress report named (its sidecar's termination message).

    The sidecar's ``/status`` is polled and its progress reports are rate-limited,
    so both may miss the last step; the final report is sent as training ends.
    """
    docs = [termination_doc(m) for m in run.messages()]
    step = _same([d.get("last_step") for d in docs])
    return step if isinstance(step, int) else None


def story(s: Scenario) -> dict[str, Any]:
    o, say = s.options, s.narrator.say
    script = o.script or BUNDLED_SCRIPT
    say(
        f"jitckpt demo: {o.nnodes} node(s) x {o.nproc_per_node} process(es) running "
        f"`{launcher(script)} {script.name}` as {o.kind} pods, checkpoints to "
        f"{s.destination.description}"
    )
    started = time.monotonic()
    reference_weights = o.reference_weights or s.workdir / "weights-uninterrupted.pt"
    resumed_weights = s.workdir / "weights-resumed.pt"
    reference = None
    if o.compare and o.reference_weights is None:
        reference = start_reference(s, reference_weights)

    first, watcher = start_first(s)
    first.wait_for_step(o.preempt_at_step, o.timeout)
    preempt(s, first)
    judged = finish_first(s, first, watcher)

    runs = resumed_runs(s, resumed_weights if o.compare else None)
    second = runs[-1].run
    restored = runs[0].restored
    failures = [line for r in runs for line in r.failures()]
    final_codes = second.exit_codes()
    final_step, max_steps = reported_last_step(second), second.max_steps()
    say(
        f"run 2 finished at step {final_step} of {max_steps or '?'}: resumed from step "
        f"{restored}, trainer exit codes {final_codes}"
    )
    model = final_model(s)
    if reference is not None:
        finish_reference(s, reference)
    equal = compare(s, resumed_weights, reference_weights) if o.compare else None
    logged = compare_log_history(s, resumed_weights, reference_weights) if o.compare else None
    saved = compare_saved_output(s) if reference is not None else None

    trainer_codes = first.exit_codes()
    jit_step = judged.jit_step
    k = o.preempt_at_step
    checks = {
        "jit checkpoint committed": judged.committed_at is not None,
        # After a JIT save every trainer container (torchrun, its PID 1) exits 143: never
        # success, and retryable for a controller (1-127 would be a permanent failure).
        f"trainers exited {JIT_EXIT_CODE} after the JIT save": bool(trainer_codes)
        and all(c == JIT_EXIT_CODE for c in trainer_codes),
        f"jit checkpoint at step {k} or {k + 1}": jit_step in (k, k + 1),
        "resumed from the jit checkpoint": restored is not None and restored == jit_step,
        "no resumed trainer failed": not failures,
        # The trainers' final progress report, for every script; the total when they said it.
        "resumed run finished": bool(final_codes)
        and all(c == 0 for c in final_codes)
        and final_step is not None
        and (max_steps is None or final_step == max_steps),
    }
    if reference is not None:
        checks["uninterrupted run finished"] = all(c == 0 for c in reference.exit_codes())
    if o.compare and not o.resharded:  # other global batches from the resume on: not bitwise
        checks["equal to uninterrupted"] = equal is True
    if logged is not None and not o.resharded:
        checks["the trainer's log equals the uninterrupted run's"] = logged.equal
    if saved is not None and not o.resharded:
        checks["what the script saved equals the uninterrupted run's"] = saved.equal is True
    ok = all(checks.values())
    failed = [name for name, passed in checks.items() if not passed]
    if ok:
        same = ", same result as the uninterrupted run" if equal else ""
        same += " and the same log" if equal and logged is not None else ""
        say(f"verdict: OK, preempted at step {k}, saved just in time, resumed{same}")
    else:
        say(f"verdict: FAILED ({'; '.join(failed)}); logs in {s.workdir / 'node' / 'pods'}")
        for line in failures:
            say(f"  {line}")
    say(f"total {time.monotonic() - started:.1f} s")
    return {
        "ok": ok,
        "kind": o.kind,
        "nnodes": o.nnodes,
        "resume_nnodes": o.resume_nnodes or o.nnodes,
        "nproc_per_node": o.nproc_per_node,
        "sidecar_mode": o.sidecar_mode,
        "preempt_nodes": o.preempt_nodes,
        "preempted_at_step": first.preempted_at_step,
        "jit_checkpoint_step": jit_step,
        "committed": judged.committed_at is not None,
        "sigterm_to_committed_s": judged.sigterm_to_committed,
        "trainer_exit_codes": trainer_codes,
        "resumed_from_step": restored,
        "final_step": final_step,
        "max_steps": max_steps,
        "final_exit_codes": final_codes,
        "resumed_runs": [r.summary() for r in runs],
        "failed_trainers": failures,
        "set_aside": [mark for r in runs for mark in r.set_aside()],
        "equal_to_uninterrupted": equal,
        "log_history": (
            {"equal": logged.equal, "detail": logged.detail(), "differing": logged.differing}
            if logged is not None
            else None
        ),
        "saved_output": saved.summary() if saved is not None else None,
        "destination": s.job_root,
        "final_model": model,
        "termination_messages": [d.get("message") for d in judged.docs],
        "trainer_logs": {
            "preempted": first.logs(),
            "resumed": second.logs(),
            "uninterrupted": reference.logs() if reference is not None else [],
        },
        "sidecar_logs": {
            "preempted": first.logs(AGENT),
            "resumed": second.logs(AGENT),
        },
        "failed_checks": failed,
        "seconds": round(time.monotonic() - started, 1),
    }


def final_model(s: Scenario) -> dict[str, Any] | None:
    """The trained model the resumed run left in ``<job root>/final/``, read from the store.

    None when there is none: the script saved no model the shim knows of (or
    ``upload-final`` is off). Not a check of the verdict: saving one is the script's choice.
    """
    from sidecar import final

    async def judge() -> final.FinalState | None:
        async with s.destination.open_store(s.job_root, s.node) as store:
            return await final.judge(store)

    state = asyncio.run(judge())
    if state is None:
        s.narrator.say("no final model in the store: the script saved none the shim knows of")
        return None
    uri = f"{s.job_root.rstrip('/')}/{state.key}"
    if state.valid:
        s.narrator.say(
            f"final model of step {state.step}: {len(state.files)} files, {state.size} bytes "
            f"at {uri}"
        )
    else:
        s.narrator.say(f"the final model at {uri} is torn: {state.reason}")
    return {
        "uri": uri,
        "valid": state.valid,
        "reason": state.reason,
        "step": state.step,
        "files": len(state.files),
        "size": state.size,
    }


def compare(s: Scenario, resumed: Path, reference: Path) -> bool:
    """Whether the shim's final weights of both runs are bitwise equal (and say so)."""
    missing = [
        f"the {name} run's"
        for name, path in (("resumed", resumed), ("uninterrupted", reference))
        if not path.exists()
    ]
    if missing:
        equal, detail = (
            False,
            (f"no final weights from {' and '.join(missing)} shim (did training end normally?)"),
        )
    else:
        comparison = compare_files(resumed, reference)
        equal = comparison.equal
        detail = (
            f"all {comparison.tensors} tensors bitwise equal"
            if equal
            else f"{len(comparison.differing)} of {comparison.tensors} tensors differ"
        )
    s.narrator.say(f"final weights, resumed vs uninterrupted: {detail}")
    return equal


def compare_log_history(s: Scenario, resumed: Path, reference: Path) -> LogComparison | None:
    """The trainer's log history of both runs, written by the shim beside the final
    weights (and said); None when neither run's framework keeps one."""
    paths = {
        name: Path(demo_log_path(str(path)))
        for name, path in (("resumed", resumed), ("uninterrupted", reference))
    }
    present = {name: path for name, path in paths.items() if path.exists()}
    if not present:
        return None
    if len(present) < len(paths):
        [missing] = set(paths) - set(present)
        comparison = LogComparison(1, [f"the {missing} run's log (it wrote none)"])
    else:
        comparison = compare_logs(read_log(paths["resumed"]), read_log(paths["uninterrupted"]))
    s.narrator.say(f"the trainer's log history, resumed vs uninterrupted: {comparison.detail()}")
    return comparison


def compare_saved_output(s: Scenario) -> SavedComparison:
    """What the script saved at the end of the resumed run and of the uninterrupted one."""
    where = s.workdir / "final"

    def side(name: str, run: str) -> tuple[Any, Path]:
        root = job_root(s.destination.uri, NAMESPACE, name)
        return (lambda: s.destination.open_store(root, s.node)), where / run

    comparison = compare_runs(
        side(s.options.job_name, "resumed"), side(s.reference_name, "uninterrupted")
    )
    s.narrator.say(f"what the script saved (final/), resumed vs uninterrupted: {comparison.detail}")
    return comparison


def _trainer_env_names(spec: dict[str, Any]) -> list[str]:
    container = spec["containers"][0]
    return [
        e["name"]
        for e in container.get("env", [])
        if e["name"].startswith(("JITCKPT", "PYTHONPATH", "TORCH"))
    ]

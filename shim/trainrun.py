"""What every framework integration shares: one training run's side of the contract.

A framework module (``frameworks/hf``, and the others beside it) knows where its loop's
step boundary is, how the framework saves and how it resumes. Everything
else is the same for all of them and lives here, so that they cannot drift
apart:

- the resume step, agreed by every rank (MIN of what each can resume from);
- the stop flag, agreed by every rank through the job's store (``agreement``), so
  every rank of every node stops at the same step even when one pod got SIGTERM,
  with no collective at a step end;
- progress reports, and the final one at the end of training;
- staging a written ``checkpoint-<step>`` for the sidecar (local rank 0, once
  every local rank has written), a JIT one streamed file by file while it is
  written when the framework's save goes through ``save_jit`` (``streaming``),
  and the exit with 143 after a JIT save, without returning into the user's code;
- the final output (the trained model the program saves once training ended
  normally), handed to the sidecar when the process exits with status 0;
- two things only ``jitckpt demo`` asks for, through env vars its generated
  pods alone carry: hold at step K until the SIGTERM arrives (so the demo
  preempts at K however fast the script trains), and write the trained
  model's weights at the normal end of training (so ``--compare`` needs
  nothing from the script). Neither changes what is saved.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence, Tuple, Union

from . import agreement, copies, dist, final, pids, protocol, streaming
from .channel import Backlog, SidecarLink
from .checkpoints import newest_checkpoint
from .config import ShimConfig
from .layout import CHECKPOINT_PREFIX, JIT_EXIT_CODE, demo_log_path
from .localcopies import LocalCopies
from .log import failed, say, say_once
from .protocol import KIND_JIT
from .session import ProcessSession
from .session import get as get_session
from .signals import FLAG
from .staging import stage
from .volumeroom import VolumeRoom

# Which staged names only this node's ranks read on the same layout (``staging.stage``).
LocalFiles = Optional[Callable[[str], bool]]

# How often the ranks holding at the demo's step ask each other whether SIGTERM came.
HOLD_POLL_SECONDS = 0.05
# A demo that never sends the SIGTERM must not hang the run: train on after this.
HOLD_TIMEOUT_SECONDS = 300.0
# The held step is reported again this often: a rate-limited report of an earlier
# step, still on its way on the progress connection, may land after the first one.
HOLD_REPORT_SECONDS = 1.0
# After a JIT save the sidecar owns the checkpoint; the goodbye (last progress, ``bye``,
# the program's own SIGTERM handler) normally takes milliseconds and may take this long.
EXIT_DEADLINE_SECONDS = 10.0
# Between the stack dump at the deadline and the forced exit (time to write the stacks).
EXIT_AFTER_STACKS_SECONDS = 0.5
# Values of the hold agreement (all-reduce MAX): nothing yet, give up, SIGTERM came.
_HOLD_WAIT, _HOLD_GIVE_UP, _HOLD_STOP = 0, 1, 2


def hand_over(
    link: SidecarLink,
    source: str,
    staging_root: str,
    step: int,
    kind: str,
    *,
    local: LocalFiles = None,
    shim_loads: bool = False,
    plan: Optional[copies.Plan] = None,
) -> Optional[str]:
    """Hard-link ``source`` into staging and tell the sidecar; the staged id, or None.
    ``shim_loads``: a framework's checkpoint the shim resumes from itself
    (``protocol.Staged``), not a script's own directory; ``plan``: what this node hands
    over of a checkpoint every node wrote (``copies``)."""
    if not link.present():
        return None
    try:
        staged = stage(
            source,
            staging_root,
            step,
            kind,
            local=local,
            shim_loads=shim_loads,
            only=plan.only if plan is not None else None,
            copies=plan is not None,
            replicas=plan.replicas if plan is not None else (),
        )
    except OSError as exc:
        failed("staging %s" % source, exc)
        return None
    staged_id = link.stage(staged)
    if staged_id is not None:
        say("%s checkpoint-%d handed to the sidecar" % (kind, step))
    return staged_id


def _exit_within(seconds: float) -> None:
    """Make sure this process ends ``seconds`` from now, with 143, whatever it waits on.

    faulthandler's own thread, which needs no GIL, prints every thread's stack
    on stderr at the deadline, so a hang is seen where it is rather than as a
    SIGKILL at the end of the grace period; a moment later a timer thread ends
    the process (it needs the GIL: any wait on a lock, a socket or a sleep lets
    it go).
    """

    def leave() -> None:
        say("still here %g s after the JIT save: exiting with %d now" % (seconds, JIT_EXIT_CODE))
        pids.unregister()
        os._exit(JIT_EXIT_CODE)

    try:
        faulthandler.dump_traceback_later(seconds, exit=False)
    except Exception as exc:  # no usable stderr: the timer still ends the process
        failed("arming the exit stack dump", exc)
    timer = threading.Timer(seconds + EXIT_AFTER_STACKS_SECONDS, leave)
    timer.daemon = True
    timer.start()


def _local(value: Any) -> Any:
    """This rank's part of a sharded tensor (FSDP2's DTensor); any other value as it is."""
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) else value


class TrainingRun:
    """The framework-neutral state of one training run in this process."""

    def __init__(self, config: ShimConfig, framework: str, marker: str) -> None:
        self.config = config
        self.framework = framework
        # The file the framework writes last into a checkpoint (``newest_checkpoint``).
        self.marker: Union[str, Tuple[str, ...]] = marker
        self.process: ProcessSession = get_session(config)
        self.jit_step: Optional[int] = None
        self.hold_at_step = config.demo_hold_at_step
        self._held = False
        self._stream: Optional[streaming.Stream] = None  # the JIT checkpoint being streamed
        # The JIT checkpoint's step and how its copies are told apart, when every node wrote it.
        self._copies: Optional[Tuple[int, copies.Copies]] = None
        self.left = False  # some rank could no longer follow the loop: no more agreement
        self._agreement: Optional[agreement.StopAgreement] = None  # from the first step end
        # Collective, run by every rank at each look while the demo holds: a periodic checkpoint
        # being written behind the loop is staged once written, as the next step end would.
        self.while_held: Optional[Callable[[], None]] = None
        # The local checkpoints the store has, freed as the next save begins (``localcopies``).
        self.local_copies = LocalCopies(config.checkpoints_dir)
        # What a periodic save written behind the loop waits for before its first file.
        self.room = VolumeRoom(self.process.link, self._free_for_room)

    # -- start ----------------------------------------------------------------
    def start(
        self, current_step: Callable[[], int], on_sigterm: Optional[Callable[[], None]] = None
    ) -> None:
        """Say hello to the sidecar and turn SIGTERM into a flag (when JIT is on).

        ``on_sigterm`` runs too when the first SIGTERM arrives (inside the signal handler).
        """
        self.process.hello(self.framework)
        if self.config.jit:

            def first() -> None:
                self.process.link.sigterm(current_step())
                if on_sigterm is not None:
                    on_sigterm()

            FLAG.install(first)

    def checkpoint_path(self, step: int) -> str:
        """Where the sidecar restores ``checkpoint-<step>`` (and where frameworks save)."""
        return os.path.join(self.config.checkpoints_dir, "%s%d" % (CHECKPOINT_PREFIX, step))

    # -- resume ---------------------------------------------------------------
    def _candidate(self) -> Optional[int]:
        self.process.wait_for_restore()  # the checkpoint is read now: it must be in place
        restored = self.process.restored
        if restored is not None and os.path.isdir(restored.path):
            return restored.step
        excluded = self.process.set_aside
        newest = newest_checkpoint(self.config.checkpoints_dir, self.marker, excluded)
        return newest[0] if newest is not None else None

    def local_resume_step(self) -> Optional[int]:
        """The step this process could resume from on its own (no agreement with other ranks)."""
        return self._candidate()

    def resume_step(self) -> Optional[int]:
        """The step every rank resumes from (None: start fresh). Collective: all ranks call it."""
        mine = self._candidate()
        step = dist.all_reduce_int(-1 if mine is None else mine, maximum=False)
        if step < 0:
            return None
        path = self.checkpoint_path(step)
        have = 1 if os.path.isdir(path) else 0
        if dist.all_reduce_int(have, maximum=False) == 0:
            say_once("resume-missing", "not every rank has %s: starting without it" % path)
            return None
        say("resuming from %s" % path)
        restored = self.process.restored
        if restored is not None and restored.step == step:
            self.local_copies.handed(path, step)  # the store has it: it was restored from there
        self.process.link.final_progress(step, 0, 0.0, resumed=step)
        return step

    # -- the step boundary ----------------------------------------------------
    def at_step_end(self, step: int, max_steps: int, epoch: float, leave: bool = False) -> bool:
        """Report progress and agree on the stop; True when every rank stops at ``step``.

        Every rank calls it after every optimizer step; it is no collective (a
        lock and two local values while nobody asked to stop: ``agreement``). Sets
        ``jit_step`` when the answer is True. ``leave``: this rank can no
        longer follow the loop; when any rank says so, every rank leaves at
        one step (``left`` turns True, the answer is False) and the run
        agrees on nothing more, so no rank waits in a collective the others
        have stopped calling.
        """
        self.process.last_step = step
        if self.left or self.jit_step is not None or not self.config.jit:
            self.process.link.progress(step, max_steps, epoch)
            return False
        if self.hold_at_step is not None and step >= self.hold_at_step and not self._held:
            self._held = True
            if dist.all_reduce_int(agreement.LEAVE if leave else agreement.GO, maximum=True):
                self.left = True
                return False
            stop = self._hold(step, max_steps, epoch)
        else:
            self.process.link.progress(step, max_steps, epoch)
            if self._agreement is None:
                self._agreement = agreement.StopAgreement.for_job(step)
            wants = agreement.LEAVE if leave else (agreement.STOP if FLAG.raised else agreement.GO)
            decision = self._agreement.at_step_end(step, wants)
            if decision is None:
                return False
            if decision.vote == agreement.LEAVE:
                self.left = True
                return False
            stop = True
        if stop:
            self.jit_step = step
            say("stopping at step %d for a JIT checkpoint" % step)
        return stop

    def _hold(self, step: int, max_steps: int, epoch: float) -> bool:
        """Demo only: wait at ``step`` until some rank got SIGTERM (every rank in lockstep).

        The step is reported at once (not rate-limited), which is what the demo waits for.
        """
        say("holding at step %d until the demo's SIGTERM arrives" % step)
        deadline = time.monotonic() + HOLD_TIMEOUT_SECONDS
        next_report = time.monotonic()
        while True:
            if time.monotonic() >= next_report:
                self.process.link.final_progress(step, max_steps, epoch)
                next_report = time.monotonic() + HOLD_REPORT_SECONDS
            if FLAG.raised:
                mine = _HOLD_STOP
            elif time.monotonic() > deadline:
                mine = _HOLD_GIVE_UP
            else:
                mine = _HOLD_WAIT
            agreed = dist.all_reduce_int(mine, maximum=True)
            if agreed == _HOLD_STOP:
                return True
            if agreed == _HOLD_GIVE_UP:
                say("no SIGTERM came while holding at step %d: training on" % step)
                return False
            if self.while_held is not None:
                try:
                    self.while_held()
                except Exception as exc:
                    failed("staging a checkpoint while holding", exc)
            time.sleep(HOLD_POLL_SECONDS)

    # -- after the framework saved ----------------------------------------------
    def save_jit(
        self,
        directory: str,
        step: int,
        save: Callable[[], Any],
        every_node: Optional[copies.Copies] = None,
    ) -> Any:
        """Run the framework's ``save`` of the JIT ``checkpoint-<step>`` into ``directory``;
        on local rank 0 each file it writes is handed to the sidecar as soon as it is
        complete, so the upload overlaps the save (``stage`` completes it).

        ``every_node``: on every rank of a job on several nodes, when ``save`` writes the
        whole checkpoint on each node (``copies``); its sidecars then share the upload.
        """
        self._copies = (step, every_node) if every_node is not None else None
        stream: Optional[streaming.Stream] = None
        try:
            if dist.ranks()["local_rank"] == 0 and self.process.link.present():
                stream = streaming.Stream(
                    self.process.link,
                    directory,
                    self.config.staging_dir,
                    step,
                    KIND_JIT,
                    copies=every_node is not None,
                )
        except Exception as exc:
            failed("streaming the JIT checkpoint", exc)
        self._stream = stream
        if stream is None:
            return save()
        with streaming.watching(stream):
            return save()

    def stage(
        self,
        directory: str,
        step: int,
        kind: str,
        local: LocalFiles = None,
        written: bool = False,
    ) -> None:
        """Every rank wrote ``directory``: local rank 0 hands it to the sidecar (completing
        it, when it was streamed while written); ``local``: ``staging.stage``'s.

        Of a JIT checkpoint every node wrote (``save_jit``'s ``every_node``), the nodes
        compare their files first, and each hands over its part (``copies.plan``).

        Collective, but for a checkpoint written behind the loop whose ranks' results
        said already that every rank wrote it (``written``; each rank may learn that at
        another step end, so no collective may follow). After a JIT save no rank leaves
        before the sidecar owns the files.
        """
        if not written:
            dist.barrier()  # every rank has finished writing its files
        plan: Optional[copies.Plan] = None
        every_node = self._copies
        if every_node is not None and every_node[0] == step and kind == KIND_JIT:
            self._copies = None
            plan = copies.plan(directory, every_node[1])  # collective: the nodes' files compared
        if dist.ranks()["local_rank"] == 0:
            stream, staged_id = self._stream, None
            if stream is not None and (stream.step, stream.kind) == (step, kind):
                self._stream = None
                staged_id = stream.finish(local, shim_loads=True, plan=plan)
                if staged_id is not None:
                    say("%s checkpoint-%d handed to the sidecar" % (kind, step))
            if staged_id is None:
                link, root = self.process.link, self.config.staging_dir
                staged_id = hand_over(
                    link, directory, root, step, kind, local=local, shim_loads=True, plan=plan
                )
            if staged_id is not None:
                self.local_copies.handed(directory, step)
        if kind == KIND_JIT:
            dist.barrier()

    def free_local(self, before: int, keep: Sequence[Optional[str]] = ()) -> None:
        """Remove the local copies of checkpoints older than ``before`` that the sidecar
        committed, but for ``keep`` (``localcopies``; local rank 0, never raises)."""
        self.local_copies.free(before, self.process.link.backlog, keep)

    def _free_for_room(self, before: int, backlog: Backlog) -> None:
        """The writer of ``before`` has room: the copies the store has go first (as at its
        save's beginning, with what that kept), so the volume holds two checkpoints."""
        self.local_copies.free(before, lambda: backlog, keep=None)

    def final_progress(self, step: int, max_steps: int, epoch: float) -> None:
        """Tell the sidecar the step training ended at (the periodic reports may lag)."""
        try:
            self.process.link.final_progress(step, max_steps, epoch)
        except Exception as exc:
            failed("the last progress report", exc)

    def exit_after_jit(self, step: int, max_steps: int, epoch: float) -> None:
        """Leave with 143 without returning into the user's code (no "final" save of a cut run).

        The sidecar owns the checkpoint already; what is left (the last progress report,
        ``bye``, the program's own SIGTERM handler) may not hold the node: past
        ``EXIT_DEADLINE_SECONDS`` the process leaves anyway.
        """
        say("JIT checkpoint-%s saved; exiting with %d" % (self.jit_step, JIT_EXIT_CODE))
        _exit_within(EXIT_DEADLINE_SECONDS)
        self.final_progress(step, max_steps, epoch)
        self.process.bye(JIT_EXIT_CODE)
        FLAG.run_previous()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream must not keep us alive
                stream.flush()
        pids.unregister()
        # os._exit: no atexit, no process-group teardown that could wait on other ranks.
        os._exit(JIT_EXIT_CODE)

    # -- the normal end -------------------------------------------------------
    def final_output(self, directory: str, files: Sequence[str], step: int) -> None:
        """The program's own code wrote its final output: ``files``, relative to ``directory``.

        Call it only for what is written once training ended normally (never
        after a JIT stop). The files are handed to the sidecar, for
        ``<job root>/final/``, when this process exits with status 0, from global
        rank 0; a crash or any other status uploads nothing (``shim/final.py``).
        """
        try:
            output = final.get(self.config, self.process.link)
            if output is not None and files:
                output.record(directory, files, step)
        except Exception as exc:
            failed("recording the final model", exc)

    def unfollowed(self, reason: str) -> None:
        """This process trains and gets no JIT checkpoint, for ``reason`` (said once in the
        trainer's log by the caller): told to the sidecar too, for its ``/status`` and
        termination message, where a platform and the job's owner look."""
        self.process.link.call(protocol.Unfollowed(reason=reason), timeout=2.0)

    def training_again(self) -> None:
        """Training starts (again): whatever was recorded as the final output is not."""
        output = final.get(self.config, self.process.link) if self.config.upload_final else None
        if output is not None:
            output.forget()

    def disarm(self) -> None:
        """The framework's training call returned or raised: SIGTERM no longer waits for a
        step boundary, and one that came after the last boundary acts now, as it would
        have without jitckpt."""
        FLAG.armed = False
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None  # the next training call agrees anew
        if FLAG.raised and self.jit_step is None:
            FLAG.raised = False
            FLAG.deliver_as_before()

    def ended_normally(self, model: Any) -> bool:
        """The framework's training call returned: True unless training stopped for a JIT
        save, and then the demo's final weights of ``model`` are written."""
        if self.jit_step is not None:
            return False
        self.capture_final_weights(model)
        return True

    def capture_final_weights(self, model: Any) -> None:
        """Demo only: rank 0 writes ``model``'s state dict where the demo asked.

        Called when training ended normally (never after a JIT stop). The
        tensors are copied to the CPU so the file compares across runs; of a
        sharded module, rank 0's shards (what the script saves is compared too),
        DeepSpeed ZeRO-3's included: its parameters hold nothing outside a gather,
        their partitions (``ds_tensor``) are what rank 0 holds.
        """
        path = self.config.demo_final_weights
        if path is None or model is None or dist.ranks()["rank"] != 0:
            return
        try:
            import torch

            inner = getattr(model, "module", model)  # DDP and friends wrap the real module
            state = {
                name: _local(value).detach().cpu() for name, value in inner.state_dict().items()
            }
            named = getattr(inner, "named_parameters", None)  # a gathered state has none
            for name, parameter in named() if callable(named) else ():
                partition = getattr(parameter, "ds_tensor", None)
                if partition is not None:
                    state[name] = partition.detach().cpu()
            temporary = "%s.tmp-%d" % (path, os.getpid())
            torch.save(state, temporary)
            os.replace(temporary, path)
            say("final weights (%d tensors) written to %s" % (len(state), path))
        except Exception as exc:
            failed("writing the final weights for the demo", exc)

    def capture_final_log(self, entries: Any) -> None:
        """Demo only: rank 0 writes the trainer's log history (a list of dicts of numbers)
        as JSON beside the final weights, for the verdict to compare.

        Called when training ended normally, like ``capture_final_weights``. A value JSON
        cannot hold is written as its ``repr``; floats are written exactly (NaN included).
        """
        path = self.config.demo_final_weights
        if path is None or dist.ranks()["rank"] != 0:
            return
        try:
            import json

            target = demo_log_path(path)
            temporary = "%s.tmp-%d" % (target, os.getpid())
            with open(temporary, "w", encoding="utf-8") as out:
                json.dump(list(entries), out, default=repr)
            os.replace(temporary, target)
            say("the trainer's log history (%d entries) written to %s" % (len(entries), target))
        except Exception as exc:
            failed("writing the trainer's log history for the demo", exc)

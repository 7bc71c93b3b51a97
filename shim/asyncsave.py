"""Periodic saves that do not stall training: snapshot at the step boundary, write behind it.

A framework's own save runs at the step boundary as it always does, inside
``BackgroundSaves.capture``. While it runs, the few functions that write
tensor files (``torch.save``, safetensors' ``save_file``: the bindings the
integration names) do not write: each call's arguments are copied to host
memory (pinned when they live on a GPU; views of one storage stay views of one
copy, so the bytes written are the same) and the call is queued. Calls the
integration marks as "after" (the framework's own "this checkpoint is
complete" file, its rotation of old checkpoints) are queued too, in order.
Everything else the save does (config files, small state) happens at once,
as usual. When the save returns, training goes on and one writer thread makes
the queued calls, in the order the save made them, with the framework's own
functions (the tensor files, opted in, through the writer process,
``writerproc``): the files are what the synchronous save writes.

The checkpoint is handed to the sidecar only once every rank's writer is done
(``written``: each rank's result through the job's store, no collective), so a
writer that fails or a process killed mid-write never stages a checkpoint; the
framework's completion file is written last, so a local resume never picks a
half-written one either.

Bounds: one save in flight (the next one waits for it, and that wait is part
of the step's stall); the snapshot's host memory is limited (half of what the
container has available, or ``JITCKPT_SNAPSHOT_BYTES``) and a write that would
exceed it happens synchronously instead; the copy is released as soon as it is
written. A JIT stop supersedes a save in flight (its writer stops after the
file it is writing and the partial directory is removed): the JIT checkpoint is
newer; one every rank had already written is still staged, as a fallback.
Before its first file, the writer waits for room on the local volume
(``volumeroom``: uploads slower than saves would otherwise put a third
checkpoint there), the snapshot in host memory; the next save drops a snapshot
still waiting rather than waiting for it, so the loop never stalls on it.
``JITCKPT_ASYNC_SAVE=false`` keeps every save synchronous.
"""

from __future__ import annotations

import copy
import os
import shutil
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from . import devicetags, dist, writecall, writerproc
from .log import failed, say, say_once
from .volumeroom import VolumeRoom
from .written import FAILED, WRITING, WRITTEN, WriteOutcome

ENV_ASYNC_SAVE = "JITCKPT_ASYNC_SAVE"
ENV_SNAPSHOT_BYTES = "JITCKPT_SNAPSHOT_BYTES"
# A write smaller than this is made at once (RNG states, scheduler, arguments): it costs less
# than copying it would.
MIN_DEFERRED_BYTES = 64 * 1024
MB = 1e6

# A deferred call: the function, its arguments (on live tensors until the snapshot rebuilds
# them on its copies) and that snapshot (None: arguments copied whole already).
Call = Tuple[Callable[..., Any], Tuple[Any, ...], Dict[str, Any], Optional["Snapshot"]]


def enabled() -> bool:
    return os.environ.get(ENV_ASYNC_SAVE, "").strip().lower() not in ("false", "0", "no", "off")


class Unsupported(Exception):
    """An argument the snapshot cannot copy faithfully: that call is made at once."""


# -- the snapshot -----------------------------------------------------------------


def _storages(obj: Any, found: Dict[Any, Any]) -> None:
    """Every tensor storage ``obj`` reaches, keyed by identity; raises on what it cannot copy."""
    import torch

    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor or obj.layout != torch.strided or obj.is_quantized:
            raise Unsupported("a %s tensor" % type(obj).__name__)
        if obj.device.type not in ("cpu", "cuda"):
            raise Unsupported("a tensor on %s" % obj.device)
        storage = obj.untyped_storage()
        found[storage_key(obj)] = storage
    elif isinstance(obj, (dict, list, tuple)):
        if type(obj) not in (dict, list, tuple) and not _is_ordered_dict(obj):
            raise Unsupported("a %s" % type(obj).__name__)
        for item in obj.values() if isinstance(obj, dict) else obj:
            _storages(item, found)
        if isinstance(obj, dict):
            for key in obj:
                _storages(key, found)
            attributes = getattr(obj, "__dict__", None)
            if attributes:  # a state_dict's _metadata
                _storages(dict(attributes), found)
    elif not _immutable(obj):
        raise Unsupported("a %s" % type(obj).__name__)


StorageKey = Tuple[str, int, int]


def storage_key(tensor: Any) -> StorageKey:
    """A storage's identity while it lives: tensors that share one get one copy."""
    storage = tensor.untyped_storage()
    return (str(tensor.device), storage.data_ptr(), storage.nbytes())


def _containers(obj: Any, memo: Optional[Dict[int, Any]] = None) -> Any:
    """``obj`` with its dicts, lists and tuples copied and its tensors the same objects: the
    structure as the save passed it, whatever the loop does to its own containers later.
    A container met twice is copied once, and an OrderedDict keeps its attributes (a
    ``state_dict``'s ``_metadata``): pickle writes the copy as it writes the original."""
    memo = {} if memo is None else memo
    if not isinstance(obj, (dict, list, tuple)):
        return obj
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, dict):
        copied: Any = type(obj)()
        memo[id(obj)] = copied
        for key, value in obj.items():
            copied[_containers(key, memo)] = _containers(value, memo)
        attributes = getattr(obj, "__dict__", None)
        if attributes:
            copied.__dict__.update(copy.deepcopy(attributes))
    else:
        copied = type(obj)(_containers(item, memo) for item in obj)
        memo[id(obj)] = copied
    return copied


def optimizer_storages(optimizers: Iterable[Any]) -> Set[StorageKey]:
    """The storages only an optimizer step changes: the parameters these optimizers update
    and their state (what the writer may copy during the next forward and backward)."""
    found: Set[StorageKey] = set()
    for optimizer in optimizers:
        for group in getattr(optimizer, "param_groups", []):
            for parameter in group.get("params", []):
                found.add(storage_key(parameter))
        for state in getattr(optimizer, "state", {}).values():
            for value in state.values() if isinstance(state, dict) else []:
                if hasattr(value, "untyped_storage"):
                    found.add(storage_key(value))
    return found


# -- the optimizer step waits for the writer's copies ----------------------------------

_ACTIVE: "weakref.WeakSet[BackgroundSaves]" = weakref.WeakSet()
_HOOK: List[Any] = []


def _wait_copied() -> None:
    for saves in list(_ACTIVE):
        try:
            saves.wait_copied()
        except Exception as exc:  # never into the user's optimizer step
            failed("waiting for the checkpoint copy", exc)


def _before_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> Any:
    """Wait for the writer's copies before the step changes what they copy. A step given a
    closure (Lightning's automatic optimization runs the forward and backward passes in it)
    waits after the closure instead, so the copy overlaps them: torch's own optimizers call
    the closure before they change anything; any other optimizer waits at once."""
    if not any(not saves.copied() for saves in list(_ACTIVE)):
        return None
    closure = kwargs.get("closure") if "closure" in kwargs else (args[0] if args else None)
    module = type(optimizer).__module__ or ""
    if not callable(closure) or not module.startswith("torch.optim"):
        _wait_copied()
        return None

    def then_wait(*inner_args: Any, **inner_kwargs: Any) -> Any:
        result = closure(*inner_args, **inner_kwargs)
        _wait_copied()
        return result

    if "closure" in kwargs:
        return args, {**kwargs, "closure": then_wait}
    return (then_wait, *args[1:]), kwargs


def _hook_installed() -> bool:
    """torch's global optimizer-step pre-hook, installed once; False where torch has none."""
    if not _HOOK:
        try:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _HOOK.append(register_optimizer_step_pre_hook(_before_optimizer_step))
        except Exception as exc:
            failed("copying parameters during the next step (they are copied at once)", exc)
            _HOOK.append(None)
    return _HOOK[0] is not None


def _is_ordered_dict(obj: Any) -> bool:
    import collections

    return type(obj) is collections.OrderedDict


def _immutable(obj: Any) -> bool:
    import torch

    return obj is None or isinstance(
        obj,
        (str, bytes, int, float, complex, bool, os.PathLike, torch.dtype, torch.device, torch.Size),
    )


class Snapshot:
    """Host copies of the storages a save's arguments reach, and the arguments rebuilt on them.

    Storages that change only at an optimizer step (``later``) are copied by the writer
    thread while the next forward and backward passes run; the optimizer step waits for
    that copy (``_before_optimizer_step``). The others are copied at once.
    """

    def __init__(
        self,
        arena: Optional[writerproc.Arena] = None,
        writer: Optional[writerproc.WriterProcess] = None,
    ) -> None:
        self.copies: Dict[Any, Any] = {}
        self.later: Dict[Any, Any] = {}
        self.nbytes = 0  # of every copy made or planned
        self.event: Any = None  # a CUDA event after the device-to-host copies, when any
        # In shared memory for the writer process, or None: in this process's memory for
        # the writer thread.
        self.arena = arena
        self.writer = writer
        self.offsets: Dict[Any, int] = {}  # storage key -> its copy's offset in the arena
        # For the writer process, GPU storages: their device, and (pinned host copy, arena
        # slot) until ``ready`` moves the first into the second.
        self.devices: Dict[Any, str] = {}
        self._pinned: List[Tuple[Any, Any]] = []

    def _copy(self, key: Any, storage: Any) -> Any:
        if self.arena is None:
            return storage.clone()
        self.offsets[key], copied = writerproc.copy_into(self.arena, storage)
        return copied

    def plan(self, storages: Dict[Any, Any]) -> None:
        """Copy these in the writer thread, before the next optimizer step."""
        for key, storage in storages.items():
            if key not in self.copies and key not in self.later:
                self.later[key] = storage
                self.nbytes += storage.nbytes()

    def take_later(self) -> None:
        """The writer thread: the copies planned for now."""
        for key, storage in self.later.items():
            self.copies[key] = self._copy(key, storage)
        self.later = {}

    def take(self, storages: Dict[Any, Any]) -> None:
        import torch

        on_gpu = False
        for key, storage in storages.items():
            if key in self.copies or key in self.later:
                continue
            if storage.device.type == "cuda":
                # Pinned: the copy is queued on the training stream and the loop goes on.
                on_gpu = True
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
                copied = host.untyped_storage()
                copied.copy_(storage, non_blocking=True)
                if self.arena is None:
                    devicetags.register(copied, storage.device)
                else:  # moved into the arena by the writer thread (``ready``)
                    self.offsets[key], slot = self.arena.slot(storage.nbytes())
                    self.devices[key] = str(storage.device)
                    self._pinned.append((host, slot))
                    copied = slot
            else:
                copied = self._copy(key, storage)
            self.copies[key] = copied
            self.nbytes += storage.nbytes()
        if on_gpu:
            # Queued on the training stream: the next step's kernels run after the copies.
            self.event = torch.cuda.Event()
            self.event.record()

    def rebuild(self, obj: Any, memo: Optional[Dict[int, Any]] = None) -> Any:
        """``obj`` (the containers ``_containers`` copied) on the copies: what is met twice
        is rebuilt once, an OrderedDict keeps its attributes."""
        import torch

        memo = {} if memo is None else memo
        if not isinstance(obj, (torch.Tensor, dict, list, tuple)):
            return obj
        if id(obj) in memo:
            return memo[id(obj)]
        rebuilt: Any
        if isinstance(obj, torch.Tensor):
            copied = self.copies[storage_key(obj)]
            rebuilt = torch.empty(0, dtype=obj.dtype, device=copied.device)
            rebuilt.set_(copied, obj.storage_offset(), obj.size(), obj.stride())
        elif isinstance(obj, dict):
            rebuilt = type(obj)()
            memo[id(obj)] = rebuilt
            for key, value in obj.items():
                rebuilt[self.rebuild(key, memo)] = self.rebuild(value, memo)
            attributes = getattr(obj, "__dict__", None)
            if attributes:
                rebuilt.__dict__.update(attributes)
        else:
            rebuilt = type(obj)(self.rebuild(item, memo) for item in obj)
        memo[id(obj)] = rebuilt
        return rebuilt

    def release(self) -> None:
        """The copies are written: forget which device they came from (their memory goes)."""
        if self.arena is not None:  # copies as uint8 tensors on the arena
            self.copies = {}
            self._pinned = []
            self.arena.close()
            return
        for copied in self.copies.values():
            if copied.device.type == "cpu":
                devicetags.forget(copied)
        self.copies = {}

    def write_in_process(
        self, function: Callable[..., Any], args: Any, kwargs: Any, cancel: threading.Event
    ) -> bool:
        """The writer process makes ``function(*args, **kwargs)`` on this snapshot; False
        when it could not and this thread made it."""
        assert self.arena is not None and self.writer is not None
        data = writerproc.payload(args, kwargs, self.offsets, self.devices, storage_key)
        try:
            self.writer.call(function, data, self.arena, cancel)
            return True
        except writerproc.CallFailed as exc:
            name = writerproc.function_name(function)
            say_once(
                "writer-process-call:%s:%s" % (name, str(exc).partition(":")[0]),
                "the checkpoint writer process could not make a %s call (%s): the writer "
                "thread in the training process writes such files"
                % (".".join(name or ("?",)), exc),
            )
            assert self.arena.map is not None
            writerproc.call_on(function, data, self.arena.map)
            return False

    def ready(self) -> None:
        """Block until the device-to-host copies are done (the writer calls it first); for
        the writer process, move them from pinned memory into the shared snapshot (a copy
        that lets the GIL go)."""
        if self.event is not None:
            self.event.synchronize()
        pinned, self._pinned = self._pinned, []
        for host, slot in pinned:
            slot.copy_(host)


# -- one save -----------------------------------------------------------------------


class SaveJob:
    """The calls one save deferred, and what became of them."""

    def __init__(self, directory: str, step: int, room: Optional[VolumeRoom] = None) -> None:
        self.directory = directory
        self.step = step
        self.room = room
        self.waiting_room = False  # the writer waits for room on the volume (``volumeroom``)
        self.held = False  # the sidecar was told it waits (``holding``)
        self.dropped = False  # a newer save began while it waited: never written
        self.finishing = threading.Event()  # training ended: the room's wait is bounded
        self.room_seconds = 0.0  # the writer's wait for room on the volume
        self.calls: List[Call] = []
        self.snapshots: List[Snapshot] = []
        self.copy_seconds = 0.0  # at the step boundary
        self.later_seconds = 0.0  # the writer's copies, before the next optimizer step
        self.write_seconds = 0.0
        self.thread_calls = 0  # calls for the writer process that the thread made instead
        self.state = WRITING
        self.error: Optional[BaseException] = None
        self.cancel = threading.Event()
        self.copied = threading.Event()  # every planned copy made: parameters may change
        self.done = threading.Event()
        self.outcome: Optional[WriteOutcome] = None  # every rank's write, once known

    def written(self) -> int:
        """This rank's result, once its writer ended (read by the outcome's thread)."""
        self.done.wait()
        return self.state

    @property
    def by_process(self) -> bool:
        """Whether the writer process writes any of its files."""
        return any(s.arena is not None for s in self.snapshots)

    @property
    def snapshot_bytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots)

    def write(self) -> None:
        """The writer thread: every deferred call in order, then the snapshot is let go."""
        started = time.monotonic()
        try:
            try:
                for snapshot in self.snapshots:
                    snapshot.take_later()
            finally:
                self.copied.set()
                self.later_seconds = time.monotonic() - started
            for snapshot in self.snapshots:
                snapshot.ready()
            if self.room is not None:
                self.waiting_room, waited = True, time.monotonic()
                try:
                    self.held = self.room.wait(self.step, self.cancel, self.finishing)
                finally:
                    self.waiting_room = False
                    self.room_seconds = time.monotonic() - waited
            for function, live_args, live_kwargs, copies in self.calls:
                if self.cancel.is_set():
                    self.state = FAILED
                    return
                if copies is None:
                    function(*live_args, **live_kwargs)
                elif copies.arena is not None:
                    try:
                        if not copies.write_in_process(
                            function, live_args, live_kwargs, self.cancel
                        ):
                            self.thread_calls += 1
                    except writerproc.Cancelled:
                        self.state = FAILED
                        return
                    copies.release()  # its shared memory, at once
                else:
                    function(*copies.rebuild(live_args), **copies.rebuild(live_kwargs))
            self.state = WRITTEN
        except BaseException as exc:  # a failed write must not end the process
            self.error = exc
            self.state = FAILED
        finally:
            self.write_seconds = time.monotonic() - started - self.room_seconds
            self.calls = []
            for snapshot in self.snapshots:
                snapshot.release()
            self.snapshots = []
            self.copied.set()
            self.done.set()


def _local_path(target: Any) -> bool:
    """Whether a write call's destination is a local file path, which a deferred write
    can write later (fsspec takes a URL elsewhere; a buffer or open file is the caller's)."""
    if not isinstance(target, (str, os.PathLike)):
        return False
    try:
        return "://" not in str(os.fspath(target))
    except Exception:
        return False


def _waited(seconds: float) -> str:
    """A save's wait for room on the volume (``volumeroom``), for its message."""
    return "" if seconds < 0.05 else ", after %.2f s in host memory waiting for room" % seconds


def _writers(by_process: bool, thread_calls: int) -> str:
    """Who wrote a save's tensor files, for its message."""
    if not by_process:
        return ""
    if thread_calls:
        return " by the writer process, %d call by the writer thread" % thread_calls
    return " by the writer process"


class _Binding:
    """One function the integration intercepts: ``owner.name``, a write or an "after" call."""

    def __init__(
        self, owner: Any, name: str, after: bool, writer: Optional[Callable[..., Any]]
    ) -> None:
        self.owner = owner
        self.name = name
        self.after = after
        self.writer = writer  # what the writer thread calls instead (same file), or None


class BackgroundSaves:
    """One process's background saves: at most one in flight, staged once every rank wrote it."""

    def __init__(self, framework: str) -> None:
        self.framework = framework
        self._bindings: List[_Binding] = []
        self._job: Optional[SaveJob] = None  # deferred writes in flight or not yet staged
        self._thread: Optional[threading.Thread] = None
        self._capturing: Optional[SaveJob] = None
        self._capture_thread = 0
        self._budget = 0
        self._stable: Set[StorageKey] = set()
        self.held_bytes = 0  # host memory the snapshot holds right now
        self.step_waited_seconds = 0.0  # optimizer steps' waits for the writer's copies
        self.waited_seconds = 0.0  # the last save's wait for the one before it
        # Say once when a write is made at once because the snapshot cannot copy it: where a
        # framework writes its whole checkpoint in one call (Lightning), that is every save.
        self.explain_unsupported = False

    # -- set up by the integration ----------------------------------------------
    def intercept(
        self,
        owner: Any,
        name: str,
        after: bool = False,
        writer: Optional[Callable[..., Any]] = None,
    ) -> None:
        """Defer ``owner.name`` during a capture: a write (tensor arguments snapshotted, or
        made at once when small or not copyable), or with ``after`` a call made after the
        writes (its arguments deep-copied now: they are small). ``writer``: what the writer
        thread calls instead of ``owner.name``, with the same arguments, writing the same
        file (one that holds the GIL less, say)."""
        if owner is not None and callable(getattr(owner, name, None)):
            self._bindings.append(_Binding(owner, name, after, writer))

    # -- the save at the step boundary ------------------------------------------
    def pending(self, step: int) -> bool:
        """Whether ``checkpoint-<step>`` is being written (or written, not yet staged) here."""
        job = self._job
        return job is not None and job.step == step

    def copied(self) -> bool:
        """Whether the writer's copies of the save in flight are made (or none is in flight)."""
        job = self._job
        return job is None or job.copied.is_set()

    def pending_step(self) -> Optional[int]:
        """The step of the save being written (or written, not yet staged), or None."""
        job = self._job
        return None if job is None else job.step

    def wait_copied(self) -> None:
        """Before an optimizer step: the writer's copies of what it changes are made."""
        job = self._job
        if job is not None and not job.copied.is_set():
            started = time.monotonic()
            job.copied.wait()
            self.step_waited_seconds += time.monotonic() - started

    def wait(self) -> None:
        """Block until the save in flight is written (one save at a time)."""
        started = time.monotonic()
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        self.waited_seconds = time.monotonic() - started

    def save(
        self,
        directory: str,
        step: int,
        save: Callable[[], Any],
        stable: Optional[Set[StorageKey]] = None,
        room: Optional[VolumeRoom] = None,
    ) -> Any:
        """Run the framework's ``save`` for ``checkpoint-<step>`` with its writes deferred, then
        start writing them behind the training loop. The caller waited and staged the save
        before this one (``wait``, ``agree_and_stage``). ``stable``: the storages (keys of
        ``storage_key``) that only an optimizer step changes, the parameters and the
        optimizer's state: those on the CPU are copied by the writer, before the next step.
        ``room``: what the writer waits for before its first file (None: nothing)."""
        job = SaveJob(directory, step, room)
        self._budget = memory_budget()
        self._stable = stable if stable is not None and _hook_installed() else set()
        self._capturing, self._capture_thread = job, threading.get_ident()
        originals = [(b, getattr(b.owner, b.name)) for b in self._bindings]
        try:
            for binding, original in originals:
                setattr(binding.owner, binding.name, self._wrapper(binding, original))
            result = save()
        finally:
            for binding, original in originals:
                setattr(binding.owner, binding.name, original)
            self._capturing = None
        self._job = job  # on every rank, deferred calls or not: every rank's result counts
        if not job.calls:  # everything was written at once (another rank may have deferred)
            job.state = WRITTEN
            job.copied.set()
            job.done.set()
            job.outcome = WriteOutcome(self.framework, job.written)
            return result
        _ACTIVE.add(self)
        self.held_bytes = job.snapshot_bytes
        job.outcome = WriteOutcome(self.framework, job.written)
        self._thread = threading.Thread(
            target=self._write, args=(job,), name="jitckpt-writer", daemon=True
        )
        self._thread.start()
        return result

    def _wrapper(self, binding: _Binding, original: Callable[..., Any]) -> Callable[..., Any]:
        def deferred(*args: Any, **kwargs: Any) -> Any:
            job = self._capturing
            if job is None or threading.get_ident() != self._capture_thread:
                return original(*args, **kwargs)  # another thread, or the capture is over
            if binding.after:
                job.calls.append((original, copy.deepcopy(args), copy.deepcopy(kwargs), None))
                return None
            return self._defer_write(job, original, args, kwargs, binding.writer)

        writecall.mark_passthrough(deferred, original)
        return deferred

    def _defer_write(
        self,
        job: SaveJob,
        original: Callable[..., Any],
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        writer: Optional[Callable[..., Any]] = None,
    ) -> Any:
        target = writecall.target(args, kwargs)
        if not _local_path(target):
            return original(*args, **kwargs)  # a buffer, an open file, a URL (fsspec): now
        storages: Dict[Any, Any] = {}
        try:
            _storages((args, kwargs), storages)
        except Unsupported as exc:
            if self.explain_unsupported:
                say_once(
                    "snapshot-unsupported:" + self.framework,
                    "a %s checkpoint holds %s, which the snapshot cannot copy: it is "
                    "written synchronously" % (self.framework, exc),
                )
            return original(*args, **kwargs)  # small objects (arguments, RNG states): now
        size = sum(s.nbytes() for s in storages.values())
        if size < MIN_DEFERRED_BYTES:
            return original(*args, **kwargs)
        if self.held_bytes + job.snapshot_bytes + size > self._budget:
            say_once(
                "snapshot-budget",
                "a checkpoint needs more host memory than the %.0f MB a snapshot may take "
                "(%s): those files are written synchronously"
                % (self._budget / MB, ENV_SNAPSHOT_BYTES),
            )
            return original(*args, **kwargs)
        started = time.monotonic()
        snapshot = self._snapshot(writer or original, storages)
        try:
            later = {
                key: storage
                for key, storage in storages.items()
                if key in self._stable and storage.device.type == "cpu"
            }
            snapshot.plan(later)
            snapshot.take({k: v for k, v in storages.items() if k not in later})
            call: Call = (writer or original, _containers(args), _containers(kwargs), snapshot)
        except Exception as exc:  # out of (pinned) memory, say: this file is written now
            snapshot.release()
            failed("snapshotting %s" % target, exc)
            return original(*args, **kwargs)
        job.snapshots.append(snapshot)
        job.calls.append(call)
        job.copy_seconds += time.monotonic() - started
        return None

    def _snapshot(self, function: Callable[..., Any], storages: Dict[Any, Any]) -> Snapshot:
        """A snapshot in shared memory for the writer process where it can write this call
        (a function it can find again), else in this process's memory. A GPU's storages
        are copied to pinned memory at the step boundary, as for the thread, then into the
        shared memory by the writer thread: host memory for both, for the write's time."""
        if writerproc.function_name(function) is None:
            return Snapshot()
        process = writerproc.shared()
        if process is None or not process.ensure_started():
            return Snapshot()
        if writerproc.mode() == writerproc.AUTO and not process.ready():
            return Snapshot()  # still starting: this save's writes are the thread's
        size = sum(writerproc.aligned(s.nbytes()) for s in storages.values())
        try:
            arena = writerproc.Arena(size)
        except Exception as exc:  # no memfd, out of memory: this process's memory
            failed("shared memory for the checkpoint writer process", exc)
            return Snapshot()
        return Snapshot(arena, process)

    def _write(self, job: SaveJob) -> None:
        snapshot_bytes, by_process = job.snapshot_bytes, job.by_process
        job.write()
        self.held_bytes = 0
        _ACTIVE.discard(self)
        if job.state == WRITTEN:
            say(
                "checkpoint-%d written behind the training loop: a %.1f MB snapshot in %s "
                "(%.3f s of copies at the step boundary, %.3f s before the next "
                "optimizer step; released after a %.2f s write%s%s)"
                % (
                    job.step,
                    snapshot_bytes / MB,
                    "shared memory" if by_process else "host memory",
                    job.copy_seconds,
                    job.later_seconds,
                    job.write_seconds,
                    _writers(by_process, job.thread_calls),
                    _waited(job.room_seconds),
                )
            )
        elif job.error is not None:
            say(
                "writing checkpoint-%d in the background failed (%s: %s): it is not staged"
                % (job.step, type(job.error).__name__, job.error)
            )
        if job.held and job.state != WRITTEN and job.room is not None:
            job.room.released(job.step)  # never staged: older uploads go on at once

    # -- after the save -------------------------------------------------------------
    def agree_and_stage(self, stage: Callable[[str, int], None], block: bool) -> None:
        """While a save is pending (every rank has one, from the same step): once every
        rank's writer is done, stage it (``stage(directory, step)``) or, if any rank
        failed, drop it. No collective: the ranks' results come through the job's store
        (``written``). ``block``: wait for this rank's writer, then for the outcome; a
        writer still waiting for room on the volume is not waited for but stopped (the
        save that follows is newer, and takes its place)."""
        job = self._job
        if job is None:
            return
        if block:
            if job.waiting_room and not job.done.is_set():
                job.dropped = True
                job.cancel.set()
            self.wait()
        agreed = job.outcome.outcome(block) if job.outcome is not None else FAILED
        if agreed == WRITING:
            return
        self._job = None
        if agreed == WRITTEN:
            stage(job.directory, job.step)
        elif job.dropped:
            say(
                "checkpoint-%d was dropped before it was written: it waited in host memory for "
                "room on the local volume, and a newer save began" % job.step
            )
            _remove(job.directory)
        else:
            say("checkpoint-%d was not written on every rank: not staged" % job.step)
            _remove(job.directory)

    def supersede(self, stage: Callable[[str, int], None]) -> None:
        """Every rank, at the JIT step: a JIT save is next, newer than the save in flight,
        whose writer stops after the file it is writing. A save every rank had written
        already is still staged (a fallback should the JIT checkpoint not make it); any
        other is dropped."""
        job = self._job
        if job is None:
            return
        in_flight = not job.done.is_set()
        job.cancel.set()
        self.wait()
        if job.state != WRITTEN:
            say("checkpoint-%d was being written when the JIT save began: dropped" % job.step)
        elif in_flight:  # its writer was past the last point where it could stop
            say(
                "checkpoint-%d was being written when the JIT save began: the JIT save "
                "waited %.2f s for it" % (job.step, self.waited_seconds)
            )
        self.agree_and_stage(stage, block=True)

    def finish(self, stage: Callable[[str, int], None], collective: bool) -> None:
        """Training ended: write what is in flight, and stage it when the ranks can agree
        (``collective``: every rank ends here too; a world of one always can)."""
        if self._job is None:
            return
        self._job.finishing.set()
        self.wait()
        if collective or dist.ranks()["world_size"] <= 1:
            self.agree_and_stage(stage, block=True)
        else:
            say_once(
                "unstaged-at-exit",
                "checkpoint-%d was written but training stopped on an error before the "
                "ranks agreed to stage it" % self._job.step,
            )


def _remove(directory: str) -> None:
    """A checkpoint directory that was never completed (every rank may remove it at once)."""
    shutil.rmtree(directory, ignore_errors=True)


# -- how much host memory a snapshot may take -----------------------------------------


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as handle:
            raw = handle.read().strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() else None


def _meminfo_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available() -> Optional[int]:
    """What the container's memory limit leaves (cgroup v2, then v1); None without a limit."""
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 1 << 60:
            return max(0, limit - usage)
    return None


def memory_budget() -> int:
    """Bytes a snapshot may hold: ``JITCKPT_SNAPSHOT_BYTES``, else half of what is available."""
    raw = os.environ.get(ENV_SNAPSHOT_BYTES, "").strip()
    if raw:
        if raw.isdigit():
            return int(raw)
        say_once(
            "env:" + ENV_SNAPSHOT_BYTES,
            "ignoring %s=%r: not a byte count" % (ENV_SNAPSHOT_BYTES, raw),
        )
    available = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
    return min(available) // 2 if available else 0

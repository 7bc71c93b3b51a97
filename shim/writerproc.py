"""The writer process: a background save's files serialized and written outside the trainer.

A writer thread in the training process shares the GIL with the training loop:
pickling a state dict and copying its bytes out holds it for much of the write,
and every step it holds it is a step the loop waits. So the tensor files of a
periodic save (``asyncsave``) are written by one separate Python process, as
torch.distributed.checkpoint's process-based async save does, with two
differences that matter inside somebody else's container:

- The snapshot of one write call lives in a ``memfd`` (anonymous shared memory,
  handed to the writer over a Unix socket with ``SCM_RIGHTS``), not in
  ``/dev/shm``, which Kubernetes gives 64 MB unless the pod mounts more; its
  memory is the pod's, and it goes when both sides unmap it: after the write,
  or when either process dies.
- The process is a fresh interpreter (``subprocess``, fork+exec), not
  ``multiprocessing``'s spawn, which would import the user's ``__main__`` again,
  and never a plain fork of a process holding gloo's threads. It gets the
  trainer's ``sys.path`` but not ``JITCKPT_DIR``, so ``sitecustomize`` does not
  activate the shim in it: it registers no pid file for the preStop hook and
  takes no lease. It holds none of the trainer's descriptors (the sidecar's
  lease included), ignores SIGINT and SIGTERM (its trainer decides when a write
  stops), and ends when its trainer does: the kernel kills it when the thread
  that started it ends (``PR_SET_PDEATHSIG``), and it leaves when its socket closes.

The writer calls the framework's own function (found again by module and
name: ``torch.save``, safetensors' ``save_file``) on the arguments the save
passed, rebuilt on the shared snapshot: the file is the one the synchronous
save writes. It is started once, at the first background save, and reused; if
it cannot start, or dies twice, the writer thread does the writes, said once.

It is opt-in (``JITCKPT_WRITER=auto`` or ``process``); the writer thread is the
default. Measured in bench/stall.py, it did not gain over the thread: on two
cores the process competes for them with the loop (its start, at the first save,
too) and at 2 GB it stalled the loop longer than the thread; on an H100 the two
were within the spread, the loop there needing little of the cores or the GIL.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import devicetags, writecall
from .log import say_once

ENV_WRITER = "JITCKPT_WRITER"
AUTO, PROCESS, THREAD = "auto", "process", "thread"
_ENV_DIR = "JITCKPT_DIR"  # what activates the shim (sitecustomize): not in the writer
_ALIGN = 64
_HEADER = struct.Struct("!Q")
_PR_SET_PDEATHSIG = 1
# How often a write the trainer waits for looks whether a JIT save cancelled it.
_CANCEL_POLL_SECONDS = 0.05
# The writer died this many times: the thread writes from then on.
_MAX_DEATHS = 2
_BOOT = (
    "import importlib, importlib.util, sys\n"
    "directory, name = sys.argv[1], sys.argv[2]\n"
    "spec = importlib.util.spec_from_file_location(\n"
    "    name, directory + '/__init__.py', submodule_search_locations=[directory])\n"
    "package = importlib.util.module_from_spec(spec)\n"
    "sys.modules[name] = package\n"
    "spec.loader.exec_module(package)\n"
    "importlib.import_module(name + '.writerproc').child_main()\n"
)


class Cancelled(Exception):
    """The write was stopped for a JIT save (the writer process was ended)."""


class CallFailed(Exception):
    """The writer process answered an error: a class only the trainer can import (one of
    its script's), say. The trainer can make the same call on the same snapshot."""


class WriterDied(Exception):
    """The writer process is gone (killed, out of memory): the file it wrote is not whole."""


def mode() -> str:
    """``JITCKPT_WRITER``: ``thread`` (the default: the writer thread), ``auto`` (the
    writer process once it has started, the thread until then) or ``process`` (the
    writer process from the first save, which then waits for it to start)."""
    raw = os.environ.get(ENV_WRITER, "").strip().lower()
    if raw in (AUTO, PROCESS, THREAD):
        return raw
    if raw:
        message = "ignoring %s=%r: not auto, process or thread" % (ENV_WRITER, raw)
        say_once("env:" + ENV_WRITER, message)
    return THREAD


# -- the snapshot in shared memory ------------------------------------------------


class Arena:
    """One write call's snapshot: a memfd the size of the storages it copies, mapped here.

    ``slot`` hands out aligned, disjoint regions as uint8 tensors; the writer maps the
    same memory and rebuilds each storage at its offset."""

    def __init__(self, size: int) -> None:
        import torch

        self.size = max(size, 1)
        self.fd = os.memfd_create("jitckpt-snapshot", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.map: Optional[mmap.mmap] = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.base: Any = torch.frombuffer(self.map, dtype=torch.uint8)
        self.used = 0

    def slot(self, nbytes: int) -> Tuple[int, Any]:
        """(offset, a uint8 tensor of ``nbytes`` at that offset)."""
        offset = self.used
        self.used = offset + aligned(nbytes)
        if self.used > self.size:
            raise ValueError("snapshot arena overflow")
        return offset, self.base[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap it here (the writer unmaps its own view): the memory goes with the last map."""
        self.base = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.map is not None:
            # A tensor on it still referenced: unmapped when that goes.
            with contextlib.suppress(BufferError):
                self.map.close()
            self.map = None


def aligned(nbytes: int) -> int:
    """What a storage of ``nbytes`` takes in an arena."""
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def copy_into(arena: Arena, storage: Any) -> Tuple[int, Any]:
    """Copy a CPU storage into the arena: (its offset, the copy as a uint8 tensor)."""
    import torch

    offset, slot = arena.slot(storage.nbytes())
    if storage.nbytes() > 0:
        slot.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
    return offset, slot


# -- the messages -------------------------------------------------------------------


def function_name(function: Callable[..., Any]) -> Optional[Tuple[str, str]]:
    """(module, qualified name) that find ``function`` again, or None (a closure, a user's
    wrapper). The shim's own wrappers are looked through (``writecall.PASSTHROUGH``)."""
    function = writecall.unwrapped(function)
    module, qualname = getattr(function, "__module__", None), getattr(function, "__qualname__", "")
    if not isinstance(module, str) or "<" in qualname:
        return None
    try:
        return (module, qualname) if resolve(module, qualname) is function else None
    except Exception:
        return None


def resolve(module: str, qualname: str) -> Any:
    """The function ``function_name`` named (in the writer, where no wrapper is installed)."""
    import importlib

    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return writecall.unwrapped(found)


def payload(
    args: Any,
    kwargs: Any,
    offsets: Dict[Any, int],
    devices: Dict[Any, str],
    key: Callable[[Any], Any],
) -> bytes:
    """The call's arguments pickled, each tensor a reference to its storage in the arena
    and the device that storage was copied from (None: the CPU)."""
    import torch

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                return (
                    offsets[key(obj)],
                    devices.get(key(obj)),
                    obj.untyped_storage().nbytes(),
                    obj.dtype,
                    obj.storage_offset(),
                    tuple(obj.size()),
                    tuple(obj.stride()),
                )
            return None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((args, kwargs))
    return buffer.getvalue()


def _rebuild(data: bytes, mapped: mmap.mmap, tagged: List[Any]) -> Tuple[Any, Any]:
    """The writer: the arguments again, their tensors on the shared snapshot (views of one
    storage stay views of one storage, as the save passed them). Copies of a GPU's
    storages are saved as on that GPU (``devicetags``), and appended to ``tagged``."""
    import torch

    storages: Dict[int, Any] = {}

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            offset, device, nbytes, dtype, storage_offset, size, stride = pid
            storage = storages.get(offset)
            if storage is None:
                if nbytes:
                    region = torch.frombuffer(
                        mapped, dtype=torch.uint8, count=nbytes, offset=offset
                    )
                    storage = region.untyped_storage()
                else:
                    storage = torch.UntypedStorage(0)
                storages[offset] = storage
                if device is not None:
                    devicetags.register(storage, device)
                    tagged.append(storage)
            tensor = torch.empty(0, dtype=dtype)
            tensor.set_(storage, storage_offset, size, stride)
            return tensor

    args, kwargs = Unpickler(io.BytesIO(data)).load()
    return args, kwargs


def call_on(function: Callable[..., Any], data: bytes, mapped: mmap.mmap) -> None:
    """``function`` on the arguments ``data`` describes, rebuilt on the snapshot ``mapped``:
    what the writer process does, and what the trainer's writer thread does with a call
    the process could not make."""
    tagged: List[Any] = []
    try:
        args, kwargs = _rebuild(data, mapped, tagged)
        function(*args, **kwargs)
        del args, kwargs
    finally:
        for storage in tagged:
            devicetags.forget(storage)


def _send(sock: socket.socket, message: Any, fds: List[int]) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(body))
    if fds:
        socket.send_fds(sock, [header], fds)
    else:
        sock.sendall(header)
    sock.sendall(body)


def _recv_exactly(sock: socket.socket, count: int, into: bytearray) -> None:
    while len(into) < count:
        chunk = sock.recv(count - len(into))
        if not chunk:
            raise EOFError
        into += chunk


def _recv(sock: socket.socket) -> Tuple[Any, List[int]]:
    """One message and the descriptors that came with it; EOFError when the peer is gone."""
    data, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
    if not data:
        raise EOFError
    header = bytearray(data)
    _recv_exactly(sock, _HEADER.size, header)
    (length,) = _HEADER.unpack(bytes(header))
    body = bytearray()
    _recv_exactly(sock, length, body)
    return pickle.loads(bytes(body)), list(fds)


# -- the trainer's side -----------------------------------------------------------


class WriterProcess:
    """The writer process of this trainer, started at the first write and reused."""

    def __init__(self) -> None:
        self._process: Optional[subprocess.Popen[bytes]] = None
        self._socket: Optional[socket.socket] = None
        self._lock = threading.Lock()  # one call on the socket at a time
        self.deaths = 0
        self._ready = False  # the writer said it imported torch

    @property
    def pid(self) -> Optional[int]:
        return None if self._process is None else self._process.pid

    def ready(self) -> bool:
        """Whether the writer is ready to write (its start, torch's import, is over): never
        waits. A save before then is written by the thread (``auto``)."""
        sock = self._socket
        if self._ready or sock is None or not self._lock.acquire(blocking=False):
            return self._ready
        try:
            if select.select([sock], [], [], 0)[0]:
                self._take_ready(sock)
        except (OSError, EOFError):
            self.deaths += 1
            self._drop()
        finally:
            self._lock.release()
        return self._ready

    def _take_ready(self, sock: socket.socket) -> None:
        message, _ = _recv(sock)
        if not message.get("ready"):
            raise EOFError
        self._ready = True

    def usable(self) -> bool:
        return self.deaths < _MAX_DEATHS

    def ensure_started(self) -> bool:
        """Start the process if it is not running (in the training thread: the kernel kills
        the writer when the thread that started it ends); False, said once, if it cannot."""
        if self._process is not None and self._process.poll() is None:
            return True
        self._drop()
        try:
            self._start()
        except Exception as exc:
            self._drop()
            self.deaths = _MAX_DEATHS
            say_once(
                "writer-process-start",
                "the checkpoint writer process could not start (%s: %s): a writer thread "
                "in the training process writes instead" % (type(exc).__name__, exc),
            )
            return False
        return True

    def _start(self) -> None:
        package = __name__.rpartition(".")[0]
        directory = os.path.dirname(os.path.abspath(__file__))
        if not sys.executable:
            raise OSError("no Python executable to start")
        env = {k: v for k, v in os.environ.items() if k != _ENV_DIR}
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, directory, package, str(theirs.fileno())],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
                close_fds=True,
            )
        finally:
            theirs.close()
        self._socket = mine
        _send(mine, {"sys_path": list(sys.path), "parent": os.getpid()}, [])
        say_once(
            "writer-process:%d" % self._process.pid,
            "periodic checkpoints are serialized and written by the writer process %d"
            % self._process.pid,
        )

    def call(
        self, function: Callable[..., Any], data: bytes, arena: Arena, cancel: threading.Event
    ) -> None:
        """Have the writer make ``function(*args, **kwargs)`` (``data``, on ``arena``);
        raises ``CallFailed`` with the writer's error, or ``WriterDied``. ``cancel`` set
        (a JIT save is next): the writer is stopped mid-file (its partial checkpoint is
        dropped) rather than waited for, and started again at the next background save
        (``Cancelled``)."""
        name = function_name(function)
        if name is None:
            raise ValueError("%r cannot be found again in the writer process" % (function,))
        with self._lock:
            sock = self._socket
            if sock is None:
                raise WriterDied("the writer process is not running")
            try:
                if not self._ready:  # ``process``: the first write waits for the start
                    self._wait_readable(sock, cancel)
                    self._take_ready(sock)
                _send(sock, {"call": name, "data": data, "size": arena.size}, [arena.fd])
                self._wait_readable(sock, cancel)
                answer, _ = _recv(sock)
            except (OSError, EOFError) as exc:
                self.deaths += 1
                self._drop()
                raise WriterDied("the writer process died (%s)" % (type(exc).__name__,)) from None
        if answer.get("error"):
            raise CallFailed(str(answer["error"]))

    def _wait_readable(self, sock: socket.socket, cancel: threading.Event) -> None:
        while not select.select([sock], [], [], _CANCEL_POLL_SECONDS)[0]:
            if cancel.is_set():
                self._drop()
                raise Cancelled("a JIT save is next")

    def _drop(self) -> None:
        self._ready = False
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                process.kill()
            with contextlib.suppress(Exception):
                process.wait(5)


_SHARED: List[WriterProcess] = []


def shared() -> Optional[WriterProcess]:
    """This process's writer (not started yet), or None where the thread writes."""
    if mode() == THREAD or not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
        return None
    if not _SHARED:
        _SHARED.append(WriterProcess())
    writer = _SHARED[0]
    if not writer.usable():
        say_once(
            "writer-process-gone",
            "the checkpoint writer process died %d times: a writer thread in the training "
            "process writes from now on" % writer.deaths,
        )
        return None
    return writer


# -- the writer's side --------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the thread that started this process ends (Linux), and leave at once if
    the trainer is gone already."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass  # no prctl: the socket's end still ends this process
    if os.getppid() != parent:
        os._exit(0)


def child_main() -> None:
    """The writer process: make each call the trainer sends, answer, until its socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[3]))
    try:
        hello, _ = _recv(sock)
    except (OSError, EOFError):
        return
    _die_with_parent(int(hello["parent"]))
    sys.path[:] = [p for p in hello["sys_path"] if isinstance(p, str)]
    import torch

    torch.set_num_threads(1)
    try:
        _send(sock, {"ready": True}, [])
    except OSError:
        return
    while True:
        try:
            request, fds = _recv(sock)
        except (OSError, EOFError):
            return
        answer: Dict[str, Any] = {}
        try:
            answer = _serve(request, fds)
        except BaseException as exc:
            answer = {"error": "%s: %s" % (type(exc).__name__, exc)}
        finally:
            for fd in fds:
                os.close(fd)
        try:
            _send(sock, answer, [])
        except OSError:
            return


def _serve(request: Dict[str, Any], fds: List[int]) -> Dict[str, Any]:
    module, qualname = request["call"]
    function = resolve(module, qualname)
    mapped = mmap.mmap(fds[0], int(request["size"]))
    try:
        call_on(function, request["data"], mapped)
    finally:
        import gc

        gc.collect()
        with contextlib.suppress(BufferError):
            mapped.close()
    return {}

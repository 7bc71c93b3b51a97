"""A JIT checkpoint handed to the sidecar file by file while it is being written.

During a JIT save on local rank 0, the functions that write a checkpoint's
files (``torch.save`` and safetensors' ``save_file``, as frameworks call
them) are wrapped: when one returns having written a file inside the
checkpoint's directory, that file is complete. It is handed over when the
save moves on to its next file (or with the rest, at the end): hard-linked
into the checkpoint's staging directory and sent with ``staging``, so the
sidecar uploads it while the rest is being written. Handing a file over one
write late keeps out what a save writes and at once removes or renames (HF's
placeholder weights under DeepSpeed ZeRO-3, a temporary name). Once every
rank has written, the usual ``staged`` hands over the rest (other ranks'
files, small files written otherwise) into the same staging directory and
completes the checkpoint; only then can the sidecar commit it. A file handed
over must still be in the checkpoint, as the same inode, when it is
completed (one written aside and renamed is not what the checkpoint holds).
Of a checkpoint every node writes (``copies``, said with each part), each
node's ``staged`` names what it hands over (``copies.plan``): a copy handed
over as it was written is left out of it when the nodes found it is no
replica and a lower node has it.

A save may write a file it wrote already: DeepSpeed ZeRO-3's under HF writes
its whole checkpoint twice (``save_model`` saves it when the weights are not
gathered, then the optimizer's save does again). The handed file is unlinked
from the checkpoint before it is written again, so the bytes the sidecar
reads never change under it; written again byte for byte the same, the
checkpoint gets the handed inode back and streaming goes on.

Streaming never stands in the way of the save: any failure (a sidecar that
does not know ``staging``, a file written again with other bytes, an error of
ours) ends it. The connection is reset, which makes the sidecar drop what it
held of the checkpoint, and the checkpoint is handed over whole, as without
streaming.
"""

from __future__ import annotations

import contextlib
import filecmp
import os
import shutil
import sys
import threading
from typing import Any, Callable, Iterator, List, Optional, Tuple

from . import writecall
from .channel import SidecarLink
from .copies import Plan
from .log import failed, say_once
from .protocol import Staging
from .staging import link_file, new_target, stage

# (module, function) of the writers watched, taken from sys.modules only: what the
# program has not imported, it cannot be saving with.
WRITERS: Tuple[Tuple[str, str], ...] = (
    ("torch", "save"),
    ("safetensors.torch", "save_file"),
    ("transformers.modeling_utils", "safe_save_file"),  # HF's own name for save_file
)


class Stream:
    """One JIT checkpoint being streamed from this process."""

    def __init__(
        self,
        link: SidecarLink,
        directory: str,
        staging_root: str,
        step: int,
        kind: str,
        *,
        copies: bool = False,
    ) -> None:
        self.link = link
        self.copies = copies  # every node writes this checkpoint (``Staging.copies``)
        self.directory = os.path.realpath(directory)
        self.staging_root = staging_root
        self.step = step
        self.kind = kind
        self.target: Optional[str] = None  # the staging directory, made at the first file
        self.handed: List[str] = []  # relative names the sidecar took
        self.broken = False
        self._pending: Optional[str] = None  # written, handed over at the next write
        self._thread = threading.get_ident()  # the thread that saves

    def _relative(self, path: Any) -> Optional[str]:
        """``path``'s name in the checkpoint (``/``-separated), or None when it is not a path
        inside it."""
        if not isinstance(path, (str, os.PathLike)):
            return None  # a buffer or an open file: not a file known complete here
        full = os.path.realpath(os.fspath(path))
        if not full.startswith(self.directory + os.sep):
            return None
        return os.path.relpath(full, self.directory).replace(os.sep, "/")

    def _path(self, relative: str) -> str:
        return os.path.join(self.directory, *relative.split("/"))

    def writing(self, path: Any) -> None:
        """A writer is about to write ``path``: the file written before is complete (handed
        over if the checkpoint still holds it); a handed file is unlinked first, so the
        write makes a new one and the sidecar's stays as it was handed."""
        if self.broken or threading.get_ident() != self._thread:
            return
        try:
            relative = self._relative(path)
            pending, self._pending = self._pending, None
            if pending is not None and pending != relative:
                self._hand(pending)
            if relative is not None and relative in self.handed and not self.broken:
                os.unlink(self._path(relative))
        except Exception as exc:
            failed("streaming %s to the sidecar" % path, exc)
            self.abandon("an error while streaming")

    def written(self, path: Any) -> None:
        """A writer returned: its file is complete, handed over at the next write."""
        if self.broken or threading.get_ident() != self._thread:
            return
        try:
            relative = self._relative(path)
            if relative is None or not os.path.isfile(self._path(relative)):
                return
            if relative in self.handed:
                self._written_again(relative)
            else:
                self._pending = relative
        except Exception as exc:
            failed("streaming %s to the sidecar" % path, exc)
            self.abandon("an error while streaming")

    def _hand(self, relative: str) -> None:
        """Hand one complete file over, if the checkpoint still holds it."""
        if not os.path.isfile(self._path(relative)):
            return  # removed, or renamed, once written: not the checkpoint's
        if self.target is None:
            self.target = new_target(self.directory, self.staging_root, self.kind)
        link_file(self.directory, self.target, relative)
        request = Staging(
            step=self.step, kind=self.kind, dir=self.target, files=(relative,), copies=self.copies
        )
        if self.link.stage_part(request) is None:
            self.abandon("the sidecar did not take %s" % relative)
            return
        self.handed.append(relative)

    def _written_again(self, relative: str) -> None:
        """A handed file was written again: the same bytes, the checkpoint gets the handed
        inode back; other bytes end streaming."""
        assert self.target is not None
        full, handed = self._path(relative), os.path.join(self.target, *relative.split("/"))
        if not filecmp.cmp(full, handed, shallow=False):
            self.abandon("%s was written again with other contents" % relative)
            return
        aside = "%s.jitckpt-%d" % (full, os.getpid())
        os.link(handed, aside)
        os.replace(aside, full)

    def finish(
        self,
        local: Optional[Callable[[str], bool]] = None,
        shim_loads: bool = False,
        plan: Optional[Plan] = None,
    ) -> Optional[str]:
        """Hand over the rest and complete the checkpoint: its staged id, or None when
        nothing was streamed or streaming failed (the caller hands it over whole);
        ``local`` and ``shim_loads``: ``staging.stage``'s; ``plan``: what this node hands
        over of a checkpoint every node wrote (``copies``)."""
        if self.broken or self.target is None:
            return None
        try:
            moved = self._moved()
            if moved is not None:  # written aside and renamed, say: not what is committed
                self.abandon("%s changed after it was handed over" % moved)
                return None
            staged = stage(
                self.directory,
                self.staging_root,
                self.step,
                self.kind,
                target_root=self.target,
                linked=self.handed,
                local=local,
                shim_loads=shim_loads,
                only=plan.only if plan is not None else None,
                copies=self.copies,
                replicas=plan.replicas if plan is not None else (),
            )
            staged_id = self.link.stage(staged)
        except Exception as exc:
            failed("completing the streamed checkpoint-%d" % self.step, exc)
            staged_id = None
        if staged_id is None:
            self.abandon("the sidecar did not complete it")
        return staged_id

    def _moved(self) -> Optional[str]:
        """A file handed over that the checkpoint no longer holds as that same inode."""
        assert self.target is not None
        for relative in self.handed:
            parts = relative.split("/")
            try:
                now = os.lstat(os.path.join(self.directory, *parts))
                handed = os.lstat(os.path.join(self.target, *parts))
            except OSError:
                return relative
            if (now.st_dev, now.st_ino) != (handed.st_dev, handed.st_ino):
                return relative
        return None

    def abandon(self, why: str) -> None:
        """Stop streaming: the sidecar drops what it held (the connection is reset), and
        the checkpoint will be handed over whole."""
        if self.broken:
            return
        self.broken = True
        say_once(
            "stream-abandoned",
            "checkpoint-%d is handed over whole once written, not file by file: %s"
            % (self.step, why),
        )
        self.link.reset()
        if self.target is not None and not self.handed:
            shutil.rmtree(self.target, ignore_errors=True)  # no sidecar holds these links


@contextlib.contextmanager
def watching(stream: Stream) -> Iterator[None]:
    """Within the block, each watched writer that returns tells ``stream`` what it wrote."""
    replaced: List[Tuple[Any, str, Callable[..., Any]]] = []
    try:
        for module_name, name in WRITERS:
            module = sys.modules.get(module_name)
            original = getattr(module, name, None)
            if module is not None and callable(original):
                setattr(module, name, _watched(original, stream))
                replaced.append((module, name, original))
    except Exception as exc:
        failed("watching the checkpoint's writers", exc)
    try:
        yield
    finally:
        for module, name, original in reversed(replaced):
            setattr(module, name, original)


def _watched(original: Callable[..., Any], stream: Stream) -> Callable[..., Any]:
    def writer(*args: Any, **kwargs: Any) -> Any:
        path = writecall.target(args, kwargs)
        stream.writing(path)
        result = original(*args, **kwargs)
        stream.written(path)
        return result

    writer.__wrapped__ = original  # type: ignore[attr-defined]
    return writer

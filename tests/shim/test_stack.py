"""The program's place as a stack of frames, in-process: saved at a loop's head, put back.

Each program here is a real loop calling a function with a loop of its own
(the innermost draws nothing from a DataLoader: its place is its own, saved
at its head as the shim saves nanoGPT's). The save watches the innermost
loop's head (``headwatch``) and takes every frame's books there
(``books.capture``, ``stack.capture``); the resumed run is the same program
started again with ``stack.Chain`` watching it, as a resumed process is.
What is saved goes through ``torch.save`` and a weights-only load.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from shim.frameworks.plain.place import books, bookvalues, headwatch, liveness, loopframe, stack
from tests.shim.test_books import run_script

pytestmark = pytest.mark.skipif(
    sys.version_info[:2] not in ((3, 11), (3, 12), (3, 13)), reason="CPython 3.11 to 3.13"
)
Saved = dict[str, Any]


def through_checkpoint(record: Saved, tmp_path: Path) -> Saved:
    path = tmp_path / "stack.pt"
    torch.save(record, path)
    loaded: Saved = torch.load(path, weights_only=True)
    return loaded


class Save:
    """At the ``at``-th call, watch the calling loop's head and take the stack there."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0
        self.saved: Saved | None = None

    def __call__(self) -> None:
        self.calls += 1
        if self.calls != self.at:
            return
        frame = sys._getframe(1)
        loop = loopframe.code_of(frame.f_code).innermost(frame.f_lasti)
        assert loop is not None
        assert headwatch.arm(frame, (loop.head, loop.entry), self.take) is None

    def take(self, frame: Any) -> None:
        offset = loopframe.code_of(frame.f_code).innermost(frame.f_lasti).head
        record, _ = books.capture(frame, set(), offset)
        outer = stack.frames(frame)[:-1]
        records, skipped = stack.capture(outer, set(), lambda _frame: None)
        heads = stack.heads(frame.f_code, offset)
        self.saved = {"books": record, "outer": records, "heads": list(heads), "skipped": skipped}


def watch(saved: Saved) -> list[str]:
    """Watch for the saved stack from the caller on; what went wrong is appended to the list."""
    problems: list[str] = []
    record = saved["books"]

    def arrived(frame: Any) -> None:
        problem = books.put_back(frame, record, offset=int(record["offset"]))
        if problem is not None:
            problems.append(problem)

    chain = stack.Chain(
        saved["outer"],
        (record["code"], tuple(saved["heads"])),
        arrived,
        lambda reason, placed: problems.append(reason),
    )
    chain.start(sys._getframe(1))
    return problems


def resume(saved: Saved, run: Callable[[], Any]) -> tuple[Any, list[str]]:
    """Run the program again with the saved stack watched for; what went wrong, if anything."""
    problems = watch(saved)
    try:
        return run(), problems
    finally:
        sys.settrace(None)


# -- two frames: a function's loop calling a function with a loop of its own ---------------
def train(history: list[float], epoch: int, hook: Callable[[], None]) -> float:
    total, hidden = 0.0, 1.0
    for i in range(4):
        hook()
        hidden = 0.5 * hidden + epoch
        total = total * 0.5 + epoch * 10 + i + hidden
        history.append(total)
    return total


def fit(hook: Callable[[], None] = lambda: None) -> tuple:
    history: list[float] = []
    lr, best, epochs_run = 1.0, None, 0
    for epoch in range(1, 4):
        loss = train(history, epoch, hook)
        epochs_run += 1
        if best is None or loss < best:
            best = loss
        else:
            lr /= 4.0
    return history, lr, best, epochs_run


def test_a_function_s_loop_calling_a_loop_of_its_own_resumes_where_it_would_end(
    tmp_path: Path,
) -> None:
    reference = fit()
    save = Save(at=6)  # epoch 2, its second batch
    fit(save)
    assert save.saved is not None
    saved = through_checkpoint(save.saved, tmp_path)
    (outer,) = saved["outer"]
    assert outer["code"]["name"] == "fit"
    assert outer["iterators"][0]["position"]["index"] == 2  # range(1, 4) drew 1 and 2
    # The call's argument is read before the call: dead after it, given back by train's books.
    assert "epoch" in outer["dead"] and outer["variables"]["lr"] == 1.0
    assert saved["books"]["variables"]["epoch"] == 2
    resumed, problems = resume(saved, fit)
    assert problems == []
    assert resumed == reference


# -- three frames, a generator between them ----------------------------------------------
def epochs(history: list[float], n: int, hook: Callable[[], None]) -> Any:
    seen = 0
    for epoch in range(1, n + 1):
        loss = train(history, epoch, hook)
        seen += 1  # noqa: SIM113 (a variable the loop changes)
        yield epoch, loss, seen


def fit_generated(hook: Callable[[], None] = lambda: None) -> tuple:
    history: list[float] = []
    losses = []
    for epoch, loss, seen in epochs(history, 3, hook):
        losses.append((epoch, loss, seen))
    return history, losses


def test_a_generator_frame_between_two_loops_is_put_back_as_it_runs_again(
    tmp_path: Path,
) -> None:
    reference = fit_generated()
    save = Save(at=7)
    fit_generated(save)
    assert save.saved is not None
    saved = through_checkpoint(save.saved, tmp_path)
    names = [record["code"]["name"] for record in saved["outer"]]
    assert names == ["fit_generated", "epochs"]
    # The outer loop iterates the generator that is the next frame: that frame is its place.
    assert saved["outer"][0]["iterators"][0]["position"]["kind"] == "stack"
    resumed, problems = resume(saved, fit_generated)
    assert problems == []
    assert resumed == reference


# -- a method's loop called from a module-level loop (a script, in its own process) --------
SCRIPT = """
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
import torch
from test_stack import Save, watch


def mode():  # the books saved here have no baseline: the script's own values are functions
    return sys.argv[1]


SAVE = Save(at=7).__call__ if mode() == "save" else None  # a method: code, never books


class Trainer:
    def __init__(self):
        self.global_step = 0
        self.hidden = torch.zeros(2)

    def fit_epoch(self, lr):
        total = 0.0
        for batch, i in enumerate(range(0, 12, 3)):
            if SAVE is not None:
                SAVE()
            self.hidden = 0.9 * self.hidden + lr * (i + 1)
            total += float(self.hidden.sum()) * (batch + 1)
            self.global_step += 1
        return total


with open(__file__) as f:  # a closed file among the module's globals
    source = f.read()
if mode() == "resume":
    problems = watch(torch.load(sys.argv[2], weights_only=True))
trainer = Trainer()
lr, best_val_loss, log = 1.0, None, []
for epoch in range(1, 4):
    val_loss = trainer.fit_epoch(lr) % 7
    if best_val_loss is None or val_loss < best_val_loss:
        best_val_loss = val_loss
    else:
        lr /= 4.0
    log.append((epoch, round(val_loss, 6), lr))
sys.settrace(None)
if mode() == "resume":
    assert problems == [], problems
if mode() == "save":
    torch.save(SAVE.__self__.saved, sys.argv[2])
print("end", trainer.global_step, trainer.hidden.tolist(), log)
"""


def test_a_method_s_loop_called_from_a_module_level_loop(tmp_path: Path) -> None:
    here = Path(__file__)
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT.format(root=str(here.parents[2]), tests=str(here.parent)))
    store = str(tmp_path / "stack.pt")

    def run(mode: str) -> str:
        printed = run_script(script, mode, store)
        return next(line for line in printed.splitlines() if line.startswith("end"))

    reference = run("full")
    assert run("save") == reference
    saved = torch.load(store, weights_only=True)
    (outer,) = saved["outer"]
    assert outer["code"]["name"] == "<module>"
    assert outer["variables"]["lr"] == 1.0 and outer["variables"]["best_val_loss"] is not None
    assert "f" in outer["dead"] and "f" not in outer["variables"]  # a closed file, never read
    assert saved["books"]["attributes"]["self"]["global_step"] == 7
    assert run("resume") == reference


# -- what is dead at the save point is not saved ------------------------------------------
class Requests:
    """Pairs of numbers; at the ``at``-th request, ``hook`` gets the requesting frame."""

    def __init__(self, n: int, hook: Callable[[Any], None], at: int) -> None:
        self.n, self.i, self.hook, self.at = n, 0, hook, at

    def __iter__(self) -> Requests:
        return self

    def __next__(self) -> tuple[int, int]:
        self.i += 1
        if self.i > self.n:
            raise StopIteration
        if self.i == self.at:
            self.hook(sys._getframe(1))
        return self.i, 2 * self.i


def batch_loop(loader: Any) -> int:
    total = 0
    for x, y in loader:
        total += x * y
    return total


def test_the_batch_in_flight_is_not_saved(tmp_path: Path) -> None:
    taken: Saved = {}
    batch_loop(Requests(4, lambda frame: taken.update(books.capture(frame, set())[0]), 3))
    record = through_checkpoint(taken, tmp_path)
    assert record["variables"] == {"total": 2 + 8}  # x, y: stored before they are read
    assert {"x", "y", "loader"} <= set(record["dead"])


def two_requests(it: Any) -> int:
    total = 0
    x = next(it)[0]
    total += x
    y = next(it)[0]
    return total + x * y


def test_a_resume_where_a_variable_left_out_is_read_first_is_refused(tmp_path: Path) -> None:
    taken: Saved = {}
    two_requests(Requests(2, lambda frame: taken.update(books.capture(frame, set())[0]), 1))
    record = through_checkpoint(taken, tmp_path)
    assert "x" in record["dead"]  # stored by the request it was taken at
    problems: list[str | None] = []
    two_requests(Requests(2, lambda frame: problems.append(books.put_back(frame, record)), 2))
    assert problems == [
        "the loop goes on at another place in its code, which reads x before it stores it"
    ]
    assert liveness.dead(two_requests.__code__, record["offset"], started=True) >= {"x", "y"}


# -- only what the loop can draw from blocks it --------------------------------------------
def drawing(meta_path: Path, hook: Callable[[], None]) -> str:
    with open(meta_path) as f:  # closed when the loop runs
        meta = f.read()
    stream = iter([1, 2, 3, 4])
    for _step in range(3):
        hook()
        next(stream)
    return meta


def not_drawing(meta_path: Path, hook: Callable[[], None]) -> str:
    with open(meta_path) as f:
        meta = f.read()
    stream = iter([1, 2, 3, 4])  # read before the loop only
    first = next(stream)
    for _step in range(3):
        hook()
    return meta * first


def test_only_an_iterator_the_loop_can_still_draw_from_blocks_it(tmp_path: Path) -> None:
    meta = tmp_path / "meta.txt"
    meta.write_text("vocab")
    found: list[str | None] = []

    def hook() -> None:
        if not found:
            found.append(books.drawn_from(sys._getframe(1)))

    drawing(meta, hook)
    assert found == [
        "the loop's variable stream is a builtins.list_iterator, whose place cannot be saved"
    ]
    found.clear()
    not_drawing(meta, hook)  # neither the closed file nor ``stream`` is read again
    assert found == [None]


def test_a_closed_file_is_named_as_one_and_never_blocks(tmp_path: Path) -> None:
    with open(tmp_path / "meta.txt", "w") as handle:
        pass
    with pytest.raises(bookvalues.Unsaveable, match=r"^a closed file$"):
        bookvalues.Encoder(set()).encode(handle)


# -- a stack that cannot be put back is said before any checkpoint ----------------------
def counted_epochs(hook: Callable[[], None]) -> None:
    for epoch in itertools.count():
        train([], epoch, hook)
        if epoch == 1:
            break


def test_a_stack_whose_outer_loop_cannot_be_set_again_is_refused_with_its_reason() -> None:
    found: list[str | None] = []

    def hook() -> None:
        if not found:
            found.append(stack.unfollowable(stack.frames(sys._getframe(1))[:-1]))

    counted_epochs(hook)
    (reason,) = found
    assert reason is not None and reason.startswith("the loop around the loop that trains, in ")
    assert reason.endswith("(counted_epochs), iterates a count, whose place cannot be saved")
    fit(hook=lambda: found.append(stack.unfollowable(stack.frames(sys._getframe(2))[:-1])))
    assert found[1:] == [None] * 12

"""A loop's own books, in-process: each kind of variable, what cannot be saved, each loop shape.

The loops here are real Python loops; a fake iterator's ``__next__`` stands
where a DataLoader's batch request is, and takes the books of its caller's
frame (``loopframe.find``) or writes them back, as the shim does at its save
and resume points. What is saved goes through ``torch.save`` and a
weights-only load, as a checkpoint does.
"""

from __future__ import annotations

import collections
import io
import itertools
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tqdm

from shim import dataloaders
from shim.frameworks.plain import programstate
from shim.frameworks.plain.place import books, bookvalues, loopframe

Hook = Callable[[Any], None] | None


class Batches:
    """``n`` batches; ``hook(frame)`` runs at the ``at``-th request, from the loop's frame."""

    def __init__(self, n: int, hook: Hook = None, at: int = -1, start: int = 0) -> None:
        self.n, self.i, self.hook, self.at = n, start, hook, at

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> int:
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        if self.hook is not None and self.i == self.at:
            frame = loopframe.find(sys._getframe(1))
            assert frame is not None
            self.hook(frame)
        return self.i


def through_checkpoint(record: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "books.pt"
    torch.save(record, path)
    loaded: dict[str, Any] = torch.load(path, weights_only=True)
    return loaded


def counter_loop(max_steps: int, hook: Hook = None, at: int = -1, first: int = 4) -> tuple:
    """``for step in range(max_steps)`` over ``next(it)``, a new iterator at each pass's end."""
    epoch = 0
    it = Batches(first, hook, at)
    running, best, patience, logged = 0.0, float("inf"), 0, []
    window: collections.deque = collections.deque(maxlen=3)
    for step in range(max_steps):
        try:
            x = next(it)
        except StopIteration:
            epoch += 1
            it = Batches(4, hook, at)
            x = next(it)
        running = 0.5 * running + x
        if running < best:
            best, patience = running, 0
        else:
            patience += 1
        logged.append(round(running, 3))
        window.append(step)
    return step, epoch, running, best, patience, logged, list(window)


def test_a_loop_bounded_by_its_own_counter_resumes_at_that_counter(tmp_path: Path) -> None:
    reference = counter_loop(13)
    taken: dict[str, Any] = {}

    def save(frame: Any) -> None:
        if "record" not in taken and frame.f_locals["epoch"] == 1:
            taken["record"], taken["skipped"] = books.capture(frame, set())

    counter_loop(13, save, at=2)
    record = through_checkpoint(taken["record"], tmp_path)
    (entry,) = record["iterators"]
    assert entry["position"]["type"] == "range_iterator" and entry["position"]["index"] == 6
    assert taken["skipped"] == []  # ``it`` is a plain iterator here: the loop's place is ours

    def resume(frame: Any) -> None:
        if "done" not in taken:
            taken["done"] = books.put_back(frame, record)

    # The resumed process: the first pass yields nothing (finished), the resume point is the
    # request inside the except clause, another place in the code than where it was saved.
    resumed = counter_loop(13, resume, at=1, first=0)
    assert taken["done"] is None
    assert resumed == reference


def while_loop(max_steps: int, hook: Hook = None, at: int = -1, first: int = 5) -> tuple:
    """``while step < max_steps``: the counter is a variable, the loop has no iterator."""
    step, seen, it = 0, [], Batches(first, hook, at)
    while step < max_steps:
        try:
            x = next(it)
        except StopIteration:
            it = Batches(5, hook, at)
            x = next(it)
        seen.append(x)
        step += 1
    return step, seen


def test_a_while_loop_bounded_by_its_own_counter_ends_where_the_uninterrupted_one_does(
    tmp_path: Path,
) -> None:
    reference = while_loop(12)
    taken: dict[str, Any] = {}

    def save(frame: Any) -> None:
        if "record" not in taken and frame.f_locals["step"] > 5:
            taken["record"] = books.capture(frame, set())[0]

    while_loop(12, save, at=3)
    record = through_checkpoint(taken["record"], tmp_path)
    assert record["iterators"] == [] and record["variables"]["step"] == 7

    def resume(frame: Any) -> None:
        if "done" not in taken:
            taken["done"] = books.put_back(frame, record)

    assert while_loop(12, resume, at=3, first=0) == reference
    assert taken["done"] is None


def progress(iterable: Any) -> Any:
    """A progress wrapper written as a generator, as tqdm's ``__iter__`` is."""
    for item in iterable:
        yield item
        print(end="", flush=True)


def wrapped_loop(max_steps: int, wrap: Callable[[Any], Any], hook: Hook = None) -> list:
    seen, it = [], Batches(3, hook, 2)
    for step in wrap(range(max_steps)):
        try:
            x = next(it)
        except StopIteration:
            it = Batches(3, hook, 2)
            x = next(it)
        seen.append((step, x))
    return seen


@pytest.mark.parametrize("wrap", [progress, tqdm.tqdm], ids=["generator", "tqdm"])
def test_a_counter_behind_a_progress_bar_resumes_at_its_place(
    wrap: Callable[[Any], Any], tmp_path: Path
) -> None:
    reference = wrapped_loop(8, wrap)
    taken: dict[str, Any] = {}

    def save(frame: Any) -> None:
        if "record" not in taken and frame.f_locals["step"] >= 3:
            taken["record"] = books.capture(frame, set())[0]

    wrapped_loop(8, wrap, save)
    record = through_checkpoint(taken["record"], tmp_path)
    (entry,) = record["iterators"]
    assert entry["position"]["kind"] == "generator"
    assert entry["position"]["inner"][0]["index"] == 5  # range(8) yielded steps 0 to 4

    def resume(frame: Any) -> None:
        if "done" not in taken:
            taken["done"] = books.put_back(frame, record)

    resumed = wrapped_loop(8, wrap, resume)
    assert taken["done"] is None
    assert resumed[-4:] == reference[-4:] and resumed[-1][0] == 7


def sliced_loop(hook: Hook = None) -> list:
    """``for x in islice(...)``, with an ``itertools.count`` beside it, whose place is lost."""
    seen, numbers = [], itertools.count()
    for x in itertools.islice(iter(range(100)), 12):
        seen.append((x, next(numbers)))
        if hook is not None:
            hook(sys._getframe())
    return seen


def test_an_islice_resumes_at_its_place_and_an_iterator_that_cannot_is_named(
    tmp_path: Path,
) -> None:
    reference = sliced_loop()
    taken: dict[str, Any] = {}

    def save(frame: Any) -> None:
        if "record" not in taken and frame.f_locals["x"] == 5:
            taken["record"], taken["skipped"] = books.capture(frame, set())

    sliced_loop(save)
    record = through_checkpoint(taken["record"], tmp_path)
    (entry,) = record["iterators"]
    assert entry["position"]["kind"] == "islice" and entry["position"]["count"] == 6
    assert dict(taken["skipped"])["numbers"].startswith("a itertools.count")

    def resume(frame: Any) -> None:
        if "done" not in taken:
            taken["done"] = books.put_back(frame, record)

    resumed = sliced_loop(resume)
    assert taken["done"] is None
    # The slice goes on where it was, as uninterrupted; the count (named) goes on from
    # where the new process had it.
    assert [x for x, _ in resumed] == [x for x, _ in reference] == list(range(12))
    assert [n for _, n in resumed] == list(range(6)) + list(range(1, 7))


class Fit:
    """A loop written as a method: its books are attributes."""

    def __init__(self) -> None:
        self.global_step = 0
        self.history: list[int] = []
        self.best = float("inf")

    def run(self, hook: Hook, at: int, resumed: bool = False) -> tuple:
        """``resumed``: as the tracker replays it, pass 0 yields nothing and pass 1 goes on
        from its third batch (a data loader fast-forwarded)."""
        for epoch in range(3):
            size = 0 if resumed and epoch == 0 else 4
            start = 2 if resumed and epoch == 1 else 0
            batches = Batches(size, hook if epoch == 1 else None, at, start)
            for index, x in enumerate(batches):
                self.global_step += 1
                self.history.append(index * x)
                self.best = min(self.best, x - index)
        return self.global_step, list(self.history), self.best, epoch


def test_a_method_loop_puts_back_its_attributes_and_enumerate_count(tmp_path: Path) -> None:
    reference = Fit().run(None, -1)
    taken: dict[str, Any] = {}
    Fit().run(lambda frame: taken.setdefault("record", books.capture(frame, set())[0]), 3)
    record = through_checkpoint(taken["record"], tmp_path)
    assert record["attributes"]["self"]["global_step"] == 6
    kinds = [entry["position"]["kind"] for entry in record["iterators"]]
    assert kinds == ["index", "enumerate"]

    def resume(frame: Any) -> None:
        if "done" not in taken:
            taken["done"] = books.put_back(frame, record)

    # The resumed run reaches its resume point at the first request of pass 1, with the
    # attributes of a fresh object and enumerate counting from 0.
    assert Fit().run(resume, 3, resumed=True) == reference
    assert taken["done"] is None


def test_each_kind_of_plain_data_comes_back_equal(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    generator.manual_seed(3)
    values = {
        "int": 7,
        "float": 0.1,
        "str": "text",
        "bool": True,
        "none": None,
        "tensor": torch.arange(6.0).reshape(2, 3),
        "list": [1, [2.5, "x"]],
        "tuple": (1, (2, 3)),
        "dict": {"a": 1, (1, 2): [3]},
        "ordered": collections.OrderedDict(b=2, a=1),
        "counter": collections.Counter("abca"),
        "default": collections.defaultdict(list, {"k": [1]}),
        "set": {1, 2, 3},
        "deque": collections.deque([1, 2], maxlen=4),
        "np_scalar": np.float32(1.5),
        "np_array": np.arange(4, dtype=np.int16),
        "torch_generator": generator,
        "random": random.Random(5),
        "numpy_generator": np.random.default_rng(9),
    }
    encoder = bookvalues.Encoder(set())
    encoded = {name: encoder.encode(value) for name, value in values.items()}
    decoded = {k: bookvalues.decode(v) for k, v in through_checkpoint(encoded, tmp_path).items()}
    for name, value in values.items():
        back = decoded[name]
        assert type(back) is type(value), name
        if isinstance(value, torch.Tensor):
            assert torch.equal(back, value)
        elif isinstance(value, np.ndarray):
            assert np.array_equal(back, value) and back.dtype == value.dtype
        elif isinstance(value, torch.Generator):
            assert torch.equal(back.get_state(), value.get_state())
        elif isinstance(value, (random.Random, np.random.Generator)):
            assert back.random() == value.random()
        else:
            assert back == value, name
            if isinstance(value, collections.deque):
                assert back.maxlen == value.maxlen
            if isinstance(value, collections.defaultdict):
                assert back.default_factory is list


def test_a_list_comes_back_into_the_object_the_program_holds() -> None:
    held = [1, 2]
    alias = held
    assert bookvalues.restore(held, [5, 6, 7]) is held
    assert alias == [5, 6, 7]


def test_what_cannot_be_saved_is_named_and_the_rest_is_still_taken(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    taken: dict[str, Any] = {}

    def loop() -> None:
        handle = io.StringIO()
        stream = (i for i in range(3))
        scale = lambda z: z  # noqa: E731
        big = torch.zeros(17 << 20)  # 68 MiB, over the limit
        weight_view = model.weight.detach()  # shares the parameter's storage
        count = 0
        for x in Batches(3, lambda frame: taken.setdefault("out", capture(frame)), 2):
            count += x
        del handle, stream, scale, big, weight_view

    def capture(frame: Any) -> Any:
        guarded = bookvalues.guarded_pointers([model], [])
        return books.capture(frame, guarded)

    loop()
    record, skipped = taken["out"]
    reasons = dict(skipped)
    assert "open file" in reasons.pop("handle")
    assert "generator" in reasons.pop("stream")
    assert reasons.pop("scale") == "a lambda"
    assert "MiB a variable may hold" in reasons.pop("big")
    assert "training state" in reasons.pop("weight_view")
    assert reasons == {}
    assert record["variables"]["count"] == 1
    through_checkpoint(record, tmp_path)  # what was taken is a loadable checkpoint


def test_what_the_loop_never_changed_is_left_to_the_next_process() -> None:
    taken: dict[str, Any] = {}

    def loop(output: str) -> None:
        args = {"output": output}
        baseline = books.fingerprints(sys._getframe())
        total = 0
        for x in Batches(
            3, lambda f: taken.setdefault("r", books.capture(f, set(), None, baseline)), 2
        ):
            total += x
        del args

    loop("first.pt")
    variables = taken["r"][0]["variables"]
    assert "total" in variables
    assert "x" not in variables and "x" in taken["r"][0]["dead"]  # the batch in flight
    assert "args" not in variables  # unchanged since before the loop: the next run keeps its own


SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import torch
from shim.frameworks.plain.place import books, headwatch, loopframe
MODE, STORE = sys.argv[1], sys.argv[2]
def save(frame):
    torch.save({{"books": books.capture(frame, set(), offset=HEAD[0])[0],
                "rng": torch.get_rng_state()}}, STORE)
    print("saved", frame.f_locals["iter_num"]); sys.exit(0)
def resume(frame):
    saved = torch.load(STORE, weights_only=True)
    assert books.put_back(frame, saved["books"], offset=HEAD[0]) is None
    torch.set_rng_state(saved["rng"])
HEAD = [None]
if MODE == "resume":
    record = torch.load(STORE, weights_only=True)["books"]
    here = loopframe.find_code(sys._getframe(), record["code"])
    HEAD[0] = record["offset"]
    assert headwatch.arm(here, (HEAD[0],), resume) is None
torch.manual_seed(0)
X = torch.randn(3)
iter_num, best, log = 0, 1e9, []
while True:
    for micro in range(2):
        loss = (X ** 2).sum()
        X = torch.randn(3)
    if MODE == "save" and iter_num == 5:
        frame = sys._getframe()
        HEAD[0] = loopframe.code_of(frame.f_code).innermost(frame.f_lasti).head
        headwatch.arm(frame, (HEAD[0],), save)
    best = min(best, loss.item())
    log.append(round(loss.item(), 4))
    iter_num += 1
    if iter_num > 10:
        break
print("end", iter_num, best, log[-3:], X.tolist())
"""


def run_script(script: Path, mode: str, store: str) -> str:
    """What ``script`` printed, run as ``script MODE STORE`` in a new interpreter."""
    done = subprocess.run(
        [sys.executable, str(script), mode, store],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(sys.version_info[:2] not in ((3, 11), (3, 12), (3, 13)), reason="CPython")
def test_a_module_level_loop_with_no_loader_resumes_at_its_head(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT.format(root=str(Path(__file__).parents[2])))
    store = str(tmp_path / "books.pt")

    def run(mode: str) -> str:
        return run_script(script, mode, store)

    reference = run("full")
    assert "saved 6" in run("save")
    resumed = run("resume")
    end = [line for line in resumed.splitlines() if line.startswith("end")]
    assert end == [line for line in reference.splitlines() if line.startswith("end")]


def test_a_tampered_record_writes_nothing(tmp_path: Path) -> None:
    """The record comes from the store: a dunder, a local the function has not, or a value
    that cannot be decoded, and nothing of it is written into the frame."""
    taken: dict[str, Any] = {}
    counter_loop(8, lambda frame: taken.setdefault("record", books.capture(frame, set())[0]), 2)
    record = through_checkpoint(taken["record"], tmp_path)
    cases = {
        "__builtins__": {**record["variables"], "__builtins__": {}},
        "intruder": {**record["variables"], "intruder": 1},
        "undecodable": {**record["variables"], "best": {bookvalues.TAG: "no-such-kind"}},
    }
    for case, variables in cases.items():
        seen: dict[str, Any] = {}

        def resume(frame: Any, variables: dict = variables, seen: dict = seen) -> None:
            if "done" not in seen:
                before = dict(frame.f_locals)
                try:
                    seen["done"] = books.put_back(frame, {**record, "variables": variables})
                except ValueError as exc:
                    seen["done"] = str(exc)
                seen["same"] = {k: v for k, v in frame.f_locals.items() if k != "frame"} == {
                    k: v for k, v in before.items() if k != "frame"
                }

        counter_loop(8, resume, at=2)
        assert seen["done"] is not None, case
        assert seen["same"], case


def test_the_shim_s_own_code_is_never_the_program_s_loop() -> None:
    """The data loaders' wrapper (``dataloaders``, in the shim's core) runs a loop around
    every batch request of a prepared Accelerate loader: its frame must never be taken for
    the program's, whose variables would be saved and written back there."""
    assert not programstate.is_program_file(dataloaders.__file__)
    assert not programstate.is_program_file(books.__file__)
    assert programstate.is_program_file(__file__)

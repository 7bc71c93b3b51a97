"""A program is what its code is: the same code at another path resumes, changed code does not.

The Kubeflow SDK writes a training function to a new
``$(mktemp -d)/ephemeral_script.py`` at every pod start
(``tests/support/kubeflow_sdk.py``). The loop's place in a checkpoint names
its code by content (``codeid``), so the resumed process finds it again in
the new file, and a program that changed is refused with its reason.
"""

from __future__ import annotations

import inspect
import os
import random
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from shim.frameworks.plain.place import books, codeid, loopframe
from tests.shim import test_books
from tests.shim.support import PYTHON, REPO, ShimEnv, Spawn, checkpoint_steps
from tests.support import kubeflow_sdk

NAMES = ("Batches", "Hook", "collections")  # what the loop's module gives it
# The loop of test_books, as the SDK ships a function: its source compiled from a file of its own.
LOOP = inspect.getsource(test_books.counter_loop)
# A function that defines a class and holds a frozenset constant (whose order of iteration
# changes with PYTHONHASHSEED).
TAGGED = """
def tagged(steps):
    class Tag:
        names = ("even", "odd")
    return [s for s in range(steps) if Tag.names[s % 2] in {"even", "none", "never"}]
"""


def compiled(path: str, source: str, name: str, above: int = 0) -> Any:
    """Function ``name`` of ``source`` compiled from ``path`` (``above`` more lines before it)."""
    namespace: dict[str, Any] = {key: getattr(test_books, key) for key in NAMES}
    exec(compile("\n" * above + source, path, "exec", dont_inherit=True), namespace)
    return namespace[name]


def loop_at(path: str, source: str = LOOP, above: int = 0) -> Any:
    return compiled(path, source, "counter_loop", above)


def taken_at_epoch_one(train: Any, tmp_path: Path) -> dict[str, Any]:
    taken: dict[str, Any] = {}

    def save(frame: Any) -> None:
        if "record" not in taken and frame.f_locals["epoch"] == 1:
            taken["record"] = books.capture(frame, set())[0]

    train(13, save, at=2)
    return test_books.through_checkpoint(taken["record"], tmp_path)


def resumed(train: Any, record: dict[str, Any]) -> tuple[Any, Any]:
    """``train`` run as a resumed process runs it: the finished pass yields nothing, the
    books are put back at the first batch request; what ``put_back`` said, and the result."""
    seen: dict[str, Any] = {}

    def resume(frame: Any) -> None:
        if "said" not in seen:
            seen["said"] = books.put_back(frame, record)

    result = train(13, resume, at=1, first=0)
    return seen["said"], result


def test_the_same_code_written_to_another_path_resumes(tmp_path: Path) -> None:
    first = loop_at(str(tmp_path / "tmp.first" / kubeflow_sdk.FILE_NAME))
    record = taken_at_epoch_one(first, tmp_path)
    reference = first(13)
    # The next pod start: a new temporary directory, and two more lines above the function.
    moved = loop_at(str(tmp_path / "tmp.second" / kubeflow_sdk.FILE_NAME), above=2)
    said, result = resumed(moved, record)
    assert said is None
    assert result == reference
    assert loopframe.same_code(moved.__code__, record["code"])


def test_a_changed_program_is_refused_with_its_reason(tmp_path: Path) -> None:
    path = str(tmp_path / kubeflow_sdk.FILE_NAME)
    record = taken_at_epoch_one(loop_at(path), tmp_path)
    # The same file, the same lines: one constant changed.
    changed = loop_at(path, LOOP.replace("0.5 * running", "0.7 * running"))
    said, _ = resumed(changed, record)
    assert said == (
        f"the loop's code in {path}:1 (counter_loop) is not the code the checkpoint was "
        f"written by (in {path}:1 (counter_loop)): the program changed"
    )
    # A statement changed is another program too, and so is a class the function defines.
    other = loop_at(path, LOOP.replace("patience += 1", "patience += 2"))
    assert not loopframe.same_code(other.__code__, record["code"])
    tagged = compiled(path, TAGGED, "tagged").__code__
    retagged = compiled(path, TAGGED.replace('"odd"', '"uneven"'), "tagged").__code__
    assert codeid.digest(tagged) != codeid.digest(retagged)


def test_the_digest_is_the_same_in_every_process(tmp_path: Path) -> None:
    """No per-process value enters it: a frozenset constant is digested in a sorted order."""
    here = codeid.digest(compiled("/a/ephemeral_script.py", TAGGED, "tagged").__code__)
    probe = (
        f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
        "from shim.frameworks.plain.place import codeid\n"
        "namespace = {}\n"
        "exec(compile(sys.stdin.read(), '/b/ephemeral_script.py', 'exec'), namespace)\n"
        "print(codeid.digest(namespace['tagged'].__code__))\n"
    )
    digests = set()
    for seed in ("1", "2", "3"):
        done = subprocess.run(
            [PYTHON, "-c", probe],
            input=TAGGED,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
            timeout=60,
            check=True,
        )
        digests.add(done.stdout.strip())
    assert digests == {here}


def train_fn(out: str, epochs: int = 3, batch_size: int = 8, lr: float = 0.1) -> None:
    """A Kubeflow SDK training function: its imports and its model class inside it."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(64, 8, generator=generator)
    labels = (features[:, 0] > 0).long()
    loader = DataLoader(TensorDataset(features, labels), batch_size=batch_size, shuffle=True)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    step, best = 0, float("inf")
    for epoch in range(epochs):
        for i, (x, y) in enumerate(loader):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            best = min(best, loss.item())
            print(f"epoch {epoch} batch {i} step {step} loss {loss.item():.6f}")
    torch.save({"model": model.state_dict(), "step": step, "best": best}, out)
    print("training done", flush=True)


def sdk_start(spawn: Spawn, env: dict[str, str], out: Path, source: str | None = None) -> Any:
    """One pod start: the program written to a new temporary directory, run by ``python -u``."""
    directory = Path(tempfile.mkdtemp(dir=out.parent))
    script = directory / kubeflow_sdk.FILE_NAME
    script.write_text(source or kubeflow_sdk.program(train_fn, {"out": str(out)}))
    return spawn([PYTHON, "-u", str(script)], env)


@pytest.mark.slow
def test_a_kubeflow_sdk_function_resumes_from_another_temporary_directory(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    step = random.Random(5454).randint(9, 15)  # 3 epochs of 8 batches, away from their ends
    reference = sdk_start(spawn, shim_env.without_shim(), tmp_path / "reference.pt")
    cut = sdk_start(
        spawn, {**shim_env.env, "JITCKPT_DEMO_HOLD_AT_STEP": str(step)}, tmp_path / "cut.pt"
    )
    cut.wait_for(f"holding at step {step} ", timeout=180)
    cut.signal(signal.SIGTERM)
    assert cut.wait(timeout=120) == 143, cut.output()[-3000:]
    assert checkpoint_steps(shim_env.checkpoints) == [step]
    assert reference.wait(timeout=180) == 0, reference.output()[-3000:]

    resumed = sdk_start(spawn, shim_env.env, tmp_path / "resumed.pt")
    assert resumed.wait(timeout=180) == 0, resumed.output()[-3000:]
    output = resumed.output()
    assert f"resumed at step {step}: DataLoader #0" in output, output[-3000:]
    assert "the loop's own variables put back" in output
    assert "no optimizer" not in cut.output() + output  # its optimizer steps: it is followed
    a = torch.load(tmp_path / "reference.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert (a["step"], a["best"]) == (b["step"], b["best"])
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])

    # The function changed (another learning rate written into it): refused before anything
    # is put back, said with its reason, and training starts over.
    source = kubeflow_sdk.program(train_fn, {"out": str(tmp_path / "changed.pt")})
    changed = sdk_start(
        spawn, shim_env.env, tmp_path / "changed.pt", source.replace("momentum=0.9", "momentum=0.8")
    )
    assert changed.wait(timeout=180) == 0, changed.output()[-3000:]
    said = [line for line in changed.output().splitlines() if "cannot resume" in line]
    assert len(said) == 1, changed.output()[-3000:]
    assert "the program changed" in said[0] and "training starts over" in said[0], said
    assert torch.load(tmp_path / "changed.pt", weights_only=True)["step"] == 24

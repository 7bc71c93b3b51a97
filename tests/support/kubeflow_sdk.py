"""A training function launched the way the Kubeflow SDK launches one.

``TrainerClient().train(trainer=CustomTrainer(func=train_fn, func_args=...))``
(and Red Hat OpenShift AI's ``TransformersTrainer(func=...)``) ships no file:
it takes the function's source (``inspect.getsource``, dedented), appends a
call to it (``train_fn()``, or ``train_fn(**{...})`` with the arguments), and
makes the trainer container's command a ``bash -c`` line that writes that
text through a heredoc into ``$(mktemp -d)/ephemeral_script.py`` and runs it
(``torchrun`` under the torch runtime, ``python`` otherwise). Every pod start
runs the line again: the program is the same, its file is new each time.
Written here from the SDK's documented behaviour, for the tests to launch the
suite's own functions that way.
"""

from __future__ import annotations

import importlib.util
import inspect
import textwrap
from pathlib import Path
from typing import Any

FILE_NAME = "ephemeral_script.py"


def function(script: Path, name: str) -> Any:
    """Function ``name`` of ``script``, imported as a notebook cell would hold it."""
    spec = importlib.util.spec_from_file_location(f"_sdk_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def program(func: Any, arguments: dict[str, Any] | None = None) -> str:
    """The text the SDK writes to ``ephemeral_script.py``: the source, then the call."""
    call = f"{func.__name__}()" if arguments is None else f"{func.__name__}(**{arguments})"
    return f"{textwrap.dedent(inspect.getsource(func))}\n{call}\n"


def command_line(func: Any, entrypoint: str, arguments: dict[str, Any] | None = None) -> str:
    """The trainer container's ``bash -c`` line: a new temporary directory, the program
    written into it through an unquoted heredoc (so the source must hold no ``$``), run."""
    return (
        "program_path=$(mktemp -d)\n"
        "read -r -d '' SCRIPT << EOM\n\n"
        f"{program(func, arguments)}"
        "EOM\n"
        f'printf "%s" "$SCRIPT" > "$program_path/{FILE_NAME}"\n'
        f'{entrypoint} "$program_path/{FILE_NAME}"\n'
    )

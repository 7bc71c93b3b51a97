"""Both images carry only their part and install exactly what that part imports.

Checked without a container engine, from the Dockerfiles themselves: which
top-level packages an image copies, which extra of ``pyproject.toml`` it
installs, and every import (module level or inside functions; not under ``if
TYPE_CHECKING``) of every module it copies. Third-party imports are matched to
distributions with ``importlib.metadata.packages_distributions`` and must lie in
the closure of the extra's requirements; each requirement of the extra must be
imported by some module, so an image installs nothing it does not run.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from shim import layout
from webhook.config import WebhookConfig

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]["name"]
FIRST_PARTY = frozenset(
    pattern.rstrip("*")
    for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
)
# What every image copies besides its own part: the command's dispatch, and the
# shim (the sidecar copies it into pods; the webhook imports its layout names).
SHARED_PARTS = frozenset({"jitckpt", "shim"})
# The shim imports these only when the user's program has (feature-detected);
# they come from the trainer's image, never from ours.
USER_STACK = frozenset(
    (
        "torch",
        "transformers",
        "accelerate",
        "lightning",
        "pytorch_lightning",
        "numpy",
        "torchtitan",
        "deepspeed",
    )
)


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            word, _, rest = stripped.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@dataclass(frozen=True)
class Image:
    """One Dockerfile at the repository root, ``Dockerfile.<part>``."""

    part: str

    @property
    def dockerfile(self) -> Path:
        return ROOT / f"Dockerfile.{self.part}"

    def instructions(self) -> list[tuple[str, str]]:
        return _instructions(self.dockerfile)

    def final_stage(self) -> list[tuple[str, str]]:
        steps = self.instructions()
        last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
        return steps[last_from:]

    def copied(self) -> set[str]:
        """The first-party top-level packages copied from the build context."""
        found = set()
        for word, rest in self.instructions():
            if word == "COPY" and not rest.startswith("--from"):
                *sources, _target = shlex.split(rest)
                found |= {s.strip("/") for s in sources if s.strip("/") in FIRST_PARTY}
        return found

    def pip_installs(self) -> list[list[str]]:
        """The arguments of each ``pip install`` in a RUN (options and their values dropped)."""
        installs = []
        for word, rest in self.instructions():
            if word != "RUN":
                continue
            for command in rest.split("&&"):
                tokens = shlex.split(command)
                if len(tokens) > 1 and tokens[0].endswith("/pip") and tokens[1] == "install":
                    args, skip = [], False
                    for token in tokens[2:]:
                        if skip:
                            skip = False
                        elif token in ("-c", "--constraint", "-r", "--requirement"):
                            skip = True
                        elif not token.startswith("-"):
                            args.append(token)
                    installs.append(args)
        return installs

    def extra(self) -> str:
        """The extra of the one ``pip install``: the project's wheel with one extra."""
        (install,) = self.pip_installs()
        (wheel,) = install
        match = re.fullmatch(rf"\$\(ls /dist/{PROJECT}-\*\.whl\)\[([\w-]+)\]", wheel)
        assert match, f"{self.dockerfile.name}: installs {wheel}, not the wheel with one extra"
        return match.group(1)

    def user(self) -> str:
        """The final stage's ``USER`` (``uid:gid``)."""
        users = [rest for word, rest in self.final_stage() if word == "USER"]
        assert users, f"{self.dockerfile.name}: the final stage sets no USER"
        return users[-1]

    def modules(self) -> list[Path]:
        return sorted(p for part in self.copied() for p in (ROOT / part).rglob("*.py"))


WEBHOOK_IMAGE, SIDECAR_IMAGE = IMAGES = [Image("webhook"), Image("sidecar")]


def _type_checking(test: ast.expr) -> bool:
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def _nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``node``, except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child.test):
            for statement in child.orelse:
                yield statement
                yield from _nodes(statement)
            continue
        yield child
        yield from _nodes(child)


@dataclass(frozen=True)
class Import:
    top: str  # the top-level package imported
    where: str  # path:line


def imports(path: Path, root: Path = ROOT) -> list[Import]:
    """Every import in the module at ``path`` under ``root`` (the repository, or an
    image's site-packages); relative ones name the module's own top package."""
    relative = path.relative_to(root)
    own = relative.parts[0]
    found = []
    for node in _nodes(ast.parse(path.read_text(), str(path))):
        where = f"{relative}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [Import(alias.name.partition(".")[0], where) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            top = own if node.level else (node.module or "").partition(".")[0]
            found.append(Import(top, where))
    return found


def _third_party(image: Image) -> dict[str, list[str]]:
    """Third-party top-level imports of the image's modules -> where each is imported."""
    found: dict[str, list[str]] = {}
    for path in image.modules():
        in_shim = path.relative_to(ROOT).parts[0] == "shim"
        for imp in imports(path):
            if imp.top in FIRST_PARTY or imp.top in sys.stdlib_module_names:
                continue
            if in_shim and imp.top in USER_STACK:
                continue
            found.setdefault(imp.top, []).append(imp.where)
    return found


def requirements(extra: str) -> list[Requirement]:
    """The extra's requirements and the project's own, self-references expanded."""
    out = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    for raw in PYPROJECT["project"]["optional-dependencies"][extra]:
        req = Requirement(raw)
        if canonicalize_name(req.name) == PROJECT:
            for inner in sorted(req.extras):
                out += requirements(inner)
        else:
            out.append(req)
    return out


@cache
def _requires(dist: str) -> tuple[str, ...]:
    return tuple(md.requires(dist) or ())


def closure(
    reqs: list[Requirement], requires: Callable[[str], Sequence[str]] = _requires
) -> set[str]:
    """Every distribution ``reqs`` install, with the extras asked for, by the metadata of
    ``requires`` (a distribution's requirements; by default as installed here)."""
    seen: set[tuple[str, str]] = set()
    todo = [(canonicalize_name(r.name), extra) for r in reqs for extra in r.extras | {""}]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        for raw in requires(name):
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo += [(canonicalize_name(req.name), e) for e in req.extras | {""}]
    return {name for name, _ in seen}


@cache
def _owners() -> dict[str, set[str]]:
    return {
        module: {canonicalize_name(d) for d in dists}
        for module, dists in md.packages_distributions().items()
    }


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.part)
def test_image_copies_its_part_and_installs_its_extra(image: Image) -> None:
    assert image.copied() == SHARED_PARTS | {image.part}
    assert image.extra() == image.part
    # The extra is the only way anything is installed: no package named in a RUN.
    assert image.pip_installs() == [[f"$(ls /dist/{PROJECT}-*.whl)[{image.part}]"]]


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.part)
def test_no_module_imports_a_part_the_image_lacks(image: Image) -> None:
    copied = image.copied()
    stray = [
        f"{imp.where} imports {imp.top}"
        for path in image.modules()
        for imp in imports(path)
        if imp.top in FIRST_PARTY - copied
    ]
    assert stray == []


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.part)
def test_every_import_is_installed_by_the_extra(image: Image) -> None:
    installed = closure(requirements(image.extra()))
    owners = _owners()
    missing = {
        module: where
        for module, where in _third_party(image).items()
        if not owners.get(module, set()) & installed
    }
    assert missing == {}, f"imported in {image.part} but not installed by its extra"


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.part)
def test_every_dependency_of_the_extra_is_imported(image: Image) -> None:
    owners = _owners()
    used = {dist for module in _third_party(image) for dist in owners.get(module, set())}
    declared = {canonicalize_name(r.name) for r in requirements(image.extra())}
    assert declared - used == set(), f"{image.part}'s extra installs what no module imports"


def test_the_images_install_no_training_stack() -> None:
    for image in IMAGES:
        installed = closure(requirements(image.extra()))
        assert not installed & {"torch", "transformers", "accelerate", "numpy", "deepspeed"}, (
            image.part
        )
    sidecar = closure(requirements("sidecar"))
    assert not sidecar & {"fastapi", "uvicorn", "starlette", "cryptography"}
    assert "aiobotocore" not in closure(requirements("webhook"))


def test_the_import_scan_sees_lazy_imports_and_skips_type_checking() -> None:
    """The scanner itself: a function-level import counts, a TYPE_CHECKING one does not."""
    module = ROOT / "shim" / "config.py"  # imports typing names only under TYPE_CHECKING
    tops = {imp.top for imp in imports(module)}
    assert "typing" not in tops and "os" in tops
    lazy = {imp.top for imp in imports(ROOT / "sidecar" / "events.py")}
    assert "kubernetes" in lazy


@pytest.mark.parametrize(
    ("image", "command", "other"),
    [(SIDECAR_IMAGE, "inject", "webhook"), (WEBHOOK_IMAGE, "agent", "sidecar")],
    ids=["sidecar", "webhook"],
)
def test_commands_of_another_part_say_so(
    image: Image, command: str, other: str, tmp_path: Path
) -> None:
    """``jitckpt`` with only the image's packages: its own commands load, the others explain."""
    for part in image.copied():
        subprocess.run(["cp", "-r", str(ROOT / part), str(tmp_path / part)], check=True)
    # The project is installed editable here: drop its finder so that only the copies load.
    run = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from jitckpt.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    own = next(n for n, (m, _) in _commands().items() if m.startswith(image.part + "."))
    argv = [sys.executable, "-I", "-c", run]  # -I: no PYTHONPATH, no current directory
    done = subprocess.run(
        [*argv, own, "--help"],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    done = subprocess.run(
        [*argv, command, "--help"],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert f"jitckpt {command}: needs jitckpt's {other} part" in done.stderr
    assert "Traceback" not in done.stderr


def _commands() -> dict[str, tuple[str, str]]:
    from jitckpt.cli import COMMANDS

    return COMMANDS


# Dockerfile rules that hold for both images.


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.part)
def test_base_images_pinned_and_multi_stage(image: Image) -> None:
    steps = image.instructions()
    args = dict(rest.split("=", 1) for word, rest in steps if word == "ARG" and "=" in rest)
    froms = [rest for word, rest in steps if word == "FROM"]
    assert len(froms) >= 2, "multi-stage: build in one stage, run from a clean one"
    for line in froms:
        ref = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], line.split()[0])
        _, _, tag = ref.partition(":")
        assert tag and tag != "latest" and re.search(r"\d", tag), ref
    builder = " ".join(rest for word, rest in steps[: len(steps) - len(image.final_stage())])
    assert "pip wheel" in builder and "-c constraints.txt" in builder
    assert any(w == "COPY" and r.startswith("--from=builder") for w, r in image.final_stage())


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.part)
def test_final_stage_runs_nothing_as_a_non_root_numeric_user(image: Image) -> None:
    final = image.final_stage()
    uid, _, gid = image.user().partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit()
    env = " ".join(rest for word, rest in final if word == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    assert not any(word == "RUN" for word, _ in final), "the final stage runs nothing as root"
    assert ("ENTRYPOINT", '["jitckpt"]') in final
    instructions = " ".join(rest for _, rest in image.instructions()).lower()
    assert "torch" not in instructions and "transformers" not in instructions


def test_sidecar_image_entrypoint_port_user_and_read_only_root() -> None:
    final = SIDECAR_IMAGE.final_stage()
    assert ("CMD", '["agent"]') in final
    assert ("EXPOSE", str(layout.STATUS_PORT)) in final
    # The injected sidecar runs as the image's user.
    config = WebhookConfig()
    assert SIDECAR_IMAGE.user() == f"{config.sidecar_user_id}:{config.sidecar_user_id}"
    env = " ".join(rest for word, rest in final if word == "ENV")
    assert "HOME=/tmp" in env and "TMPDIR=/tmp" in env
    # readOnlyRootFilesystem: bytecode is compiled at build time, never written at run time.
    assert any(w == "RUN" and "compileall" in r for w, r in SIDECAR_IMAGE.instructions())
    copies = [rest.split()[-1] for word, rest in final if word == "COPY"]
    for target in copies:
        for volume in (layout.SHIM_ROOT, layout.LOCAL_DIR, layout.RUN_DIR, layout.PVC_MOUNT):
            assert not target.startswith(volume), f"{target} would be hidden by {volume}"


def test_webhook_image_serves_on_its_port() -> None:
    final = WEBHOOK_IMAGE.final_stage()
    (cmd,) = [rest for word, rest in final if word == "CMD"]
    assert cmd.startswith('["webhook", "serve"') and '"8443"' in cmd
    assert ("EXPOSE", "8443") in final


def test_dockerignore_keeps_the_context_to_what_images_copy() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "tests"} <= ignored
    copied = {part for image in IMAGES for part in image.copied()}
    assert FIRST_PARTY - copied <= ignored, "a part no image copies stays out of the context"
    for needed in ("pyproject.toml", "constraints.txt", "README.md", *copied):
        assert needed not in ignored


def test_the_context_of_this_checkout_is_what_the_images_copy() -> None:
    """What a checkout holds after `make setup` and a test run (the scanner's venv, caches,
    the Makefile) is outside the context: the image build's cache key hashes it, and a
    file there that differs between checkouts rebuilds both images in every one."""
    from tools.images.build import context_files

    copied = {part for image in IMAGES for part in image.copied()}
    allowed = {"pyproject.toml", "constraints.txt", "README.md", ".dockerignore", *copied}
    allowed |= {image.dockerfile.name for image in IMAGES}
    tops = {path.relative_to(ROOT).parts[0] for path in context_files(ROOT)}
    assert tops <= allowed, tops - allowed

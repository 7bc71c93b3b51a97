"""Dockerfile.sidecar rules that can be checked without a container engine."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import shlex
import sys
from pathlib import Path

from packaging.requirements import Requirement

from shim import layout

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile.sidecar"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            word, _, rest = stripped.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _final_stage() -> list[tuple[str, str]]:
    steps = _instructions()
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def _pip_packages() -> list[str]:
    names: list[str] = []
    for word, rest in _instructions():
        if word != "RUN":
            continue
        for command in rest.split("&&"):
            tokens = shlex.split(command)
            if tokens[:1] == ["/app/bin/pip"] and tokens[1] == "install":
                names += [t for t in tokens[2:] if not t.startswith("-") and "/" not in t]
    return [n for n in names if n != "constraints.txt"]


def test_base_images_pinned_and_multi_stage() -> None:
    steps = _instructions()
    args = dict(rest.split("=", 1) for word, rest in steps if word == "ARG" and "=" in rest)
    froms = [rest for word, rest in steps if word == "FROM"]
    assert len(froms) >= 2
    for image in froms:
        ref = image.split()[0]
        ref = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref)
        assert ":" in ref and not ref.endswith(":latest"), ref
    assert any(w == "COPY" and rest.startswith("--from=builder") for w, rest in _final_stage())


def test_non_root_numeric_user_and_read_only_root() -> None:
    final = _final_stage()
    users = [rest for word, rest in final if word == "USER"]
    assert users, "the final stage sets a USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit()
    env = " ".join(rest for word, rest in final if word == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    assert "HOME=/tmp" in env and "TMPDIR=/tmp" in env
    assert any(w == "RUN" and "compileall" in r for w, r in _instructions())
    assert not any(word == "RUN" for word, _ in final), "the final stage runs nothing as root"


def test_entrypoint_port_and_install_location() -> None:
    final = _final_stage()
    assert ("ENTRYPOINT", '["jitckpt"]') in final
    assert ("CMD", '["agent"]') in final
    assert ("EXPOSE", str(layout.STATUS_PORT)) in final
    copies = [rest.split()[-1] for word, rest in final if word == "COPY"]
    for target in copies:
        for volume in (layout.SHIM_ROOT, layout.LOCAL_DIR, layout.RUN_DIR, layout.PVC_MOUNT):
            assert not target.startswith(volume), f"{target} would be hidden by {volume}"


def test_no_training_stack_or_web_framework() -> None:
    packages = {p.lower() for p in _pip_packages()}
    assert packages, "the Dockerfile installs the sidecar's dependencies by name"
    assert not packages & {"torch", "transformers", "accelerate", "fastapi", "uvicorn"}


def _closure(names: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = [n.lower().replace("_", "-") for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for raw in md.requires(name) or []:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name.lower().replace("_", "-"))
    return seen


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_installed_packages_cover_what_the_agent_imports() -> None:
    """Every third-party module the sidecar's code imports (eagerly or lazily) comes from a
    distribution the Dockerfile installs, directly or as a dependency."""
    # The sidecar runs shim/layout.py and shim/protocol.py; the rest of the shim runs in the
    # trainer's Python (with the trainer's torch), which the sidecar only copies.
    shared = [ROOT / "shim" / name for name in ("__init__.py", "layout.py", "protocol.py")]
    sources = [ROOT / "jitckpt" / "cli.py", *shared]
    for path in (ROOT / "sidecar").rglob("*.py"):
        if not {"demo", "podrunner"} & set(path.relative_to(ROOT).parts):
            sources.append(path)
    modules = set().union(*(_imports(p) for p in sources))
    owners = md.packages_distributions()
    allowed = _closure(_pip_packages())
    missing = {}
    for module in sorted(
        modules - {"jitckpt", "webhook", "sidecar", "shim", "local"} - set(sys.stdlib_module_names)
    ):
        dists = {d.lower().replace("_", "-") for d in owners.get(module, [])}
        if not dists & allowed:
            missing[module] = sorted(dists)
    assert "aiobotocore" in modules and "kubernetes" in modules
    assert missing == {}, f"imported but not installed in the image: {missing}"


def _top_level_imports(module: str) -> set[str]:
    """Modules ``module`` imports when it is loaded, following first-party ones."""
    seen: set[str] = set()
    todo = [module]
    found: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = ROOT / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / name.replace(".", "/") / "__init__.py"
        for node in ast.parse(path.read_text()).body:
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for imported in names:
                top = imported.split(".")[0]
                if top in ("jitckpt", "webhook", "sidecar", "shim", "local"):
                    todo.append(imported)
                else:
                    found.add(top)
    return found


def test_every_jitckpt_command_loads_in_the_sidecar_image() -> None:
    """``jitckpt`` builds all subcommand parsers at start: none may need a package the
    sidecar image lacks just to be imported."""
    from jitckpt.cli import COMMANDS

    allowed = _closure(_pip_packages())
    owners = md.packages_distributions()
    for module, _help in COMMANDS.values():
        for top in _top_level_imports(module) - set(sys.stdlib_module_names):
            dists = {d.lower().replace("_", "-") for d in owners.get(top, [])}
            assert dists & allowed, f"{module} imports {top} at module level"

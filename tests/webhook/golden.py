"""Golden cases for the injector, in the style of Istio's ``testdata/inject``.

Each case in ``testdata/inject/`` is

- ``<case>.in.yaml``: the pod as the API server hands it to the webhook, after
  any ``Namespace`` documents that give its namespace's labels and annotations;
- ``<case>.config.yaml`` (optional): the webhook's config file;
- ``<case>.out.yaml``: the pod after mutation (golden);
- ``<case>.result.yaml``: injected?, skip reason, message, warnings, deny and
  audit annotations (golden).

Every path that injects (the pure core, the HTTP server, ``jitckpt inject``)
loads cases with ``discover()``, runs its own way, and calls ``check_pod`` /
``check_result`` with what it got; ``--update-golden`` rewrites the goldens.
A case whose namespace is not opted in is only meaningful where the opt-in
is required (``Case.offline``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from webhook.config import WebhookConfig, load_config
from webhook.mutate import SKIP_NOT_OPTED_IN, MutationResult, NamespaceInfo

INJECT_DIR = Path(__file__).parent / "testdata" / "inject"
SUFFIXES = (".in.yaml", ".config.yaml", ".out.yaml", ".result.yaml")
# Whole-command goldens for ``jitckpt inject`` on objects that are not pods
# (PyTorchJob, TrainJob): <case>.in.yaml -> <case>.out.yaml + <case>.stderr.
CLI_DIR = Path(__file__).parent / "testdata" / "cli"
CLI_SUFFIXES = (".in.yaml", ".out.yaml", ".stderr")


@dataclass(frozen=True)
class Case:
    """One golden case: the admission inputs and where its goldens live."""

    name: str
    input_path: Path
    pod: dict[str, Any]
    namespace: NamespaceInfo
    config: WebhookConfig
    config_path: Path | None

    @property
    def output_path(self) -> Path:
        return INJECT_DIR / f"{self.name}.out.yaml"

    @property
    def result_path(self) -> Path:
        return INJECT_DIR / f"{self.name}.result.yaml"

    def expected_pod(self) -> dict[str, Any]:
        return load_yaml(self.output_path)

    def expected_result(self) -> dict[str, Any]:
        return load_yaml(self.result_path)

    @property
    def offline(self) -> bool:
        """Whether ``jitckpt inject`` (no opt-in needed) must give the same pod."""
        return bool(self.expected_result().get("skip_reason") != SKIP_NOT_OPTED_IN)


def load_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path}: not a mapping"
    return data


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)


def _case(input_path: Path) -> Case:
    name = input_path.name.removesuffix(".in.yaml")
    docs = [d for d in yaml.safe_load_all(input_path.read_text()) if d is not None]
    pods = [d for d in docs if d.get("kind") == "Pod"]
    assert len(pods) == 1, f"{input_path}: expected exactly one Pod document"
    pod = pods[0]
    ns_name = pod.get("metadata", {}).get("namespace", "default")
    namespace = NamespaceInfo(name=ns_name, labels={}, annotations={})
    for doc in docs:
        meta = doc.get("metadata", {})
        if doc.get("kind") == "Namespace" and meta.get("name") == ns_name:
            namespace = NamespaceInfo(
                name=ns_name,
                labels=meta.get("labels") or {},
                annotations=meta.get("annotations") or {},
            )
    config_path = INJECT_DIR / f"{name}.config.yaml"
    if not config_path.exists():
        return Case(name, input_path, pod, namespace, load_config(None), None)
    return Case(name, input_path, pod, namespace, load_config(config_path), config_path)


def discover() -> list[Case]:
    """Every case under ``testdata/inject``, sorted by name."""
    return [_case(p) for p in sorted(INJECT_DIR.glob("*.in.yaml"))]


def cli_cases() -> list[Path]:
    """The input files of the whole-command cases."""
    return sorted(CLI_DIR.glob("*.in.yaml"))


def _unused(directory: Path, suffixes: tuple[str, ...]) -> list[Path]:
    names = {p.name.removesuffix(".in.yaml") for p in directory.glob("*.in.yaml")}
    unused = []
    for path in sorted(directory.iterdir()):
        suffix = next((s for s in suffixes if path.name.endswith(s)), None)
        if suffix is None or path.name.removesuffix(suffix) not in names:
            unused.append(path)
    return unused


def unused_files() -> list[Path]:
    """Files in the golden directories that belong to no case (stale goldens)."""
    return _unused(INJECT_DIR, SUFFIXES) + _unused(CLI_DIR, CLI_SUFFIXES)


def check_text(path: Path, actual: str, update: bool = False) -> None:
    """Compare text output with the golden file ``path`` (or rewrite it)."""
    if update:
        path.write_text(actual)
        return
    assert path.exists(), f"{path.name} is missing: run pytest with --update-golden"
    assert actual == path.read_text(), f"{path.name} differs (--update-golden if intended)"


def summarize(result: MutationResult) -> dict[str, Any]:
    """The golden-checked fields of a MutationResult other than the pod."""
    return {
        "injected": result.injected,
        "skip_reason": result.skip_reason,
        "deny": result.deny,
        "message": result.message,
        "warnings": list(result.warnings),
        "audit_annotations": dict(result.audit_annotations),
    }


def _compare(path: Path, actual: dict[str, Any], update: bool) -> None:
    if update:
        path.write_text(dump_yaml(actual))
        return
    assert path.exists(), f"{path.name} is missing: run pytest with --update-golden"
    expected = load_yaml(path)
    if actual != expected:
        raise AssertionError(
            f"{path.name} differs (run pytest with --update-golden if intended):\n"
            f"--- expected\n{dump_yaml(expected)}\n--- actual\n{dump_yaml(actual)}"
        )


def check_pod(case: Case, pod: dict[str, Any], update: bool = False) -> None:
    """Compare a mutated pod with the case's ``out.yaml`` (or rewrite it)."""
    _compare(case.output_path, pod, update)


def check_result(case: Case, summary: dict[str, Any], update: bool = False) -> None:
    """Compare ``summarize(result)`` with the case's ``result.yaml`` (or rewrite it)."""
    _compare(case.result_path, summary, update)

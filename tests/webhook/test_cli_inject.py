"""``jitckpt inject`` as users run it: the console script in a subprocess."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kubernetes_validate import utils as kv

from local.podrunner.spec import ObjectStore, PodContext, container_env
from sidecar.config import AgentConfig
from tests.webhook.cli_support import documents, jitckpt
from tests.webhook.golden import (
    CLI_DIR,
    Case,
    check_pod,
    check_text,
    cli_cases,
    discover,
    load_yaml,
)
from webhook.mutate import SKIP_INVALID_SETTING
from webhook.settings import STATUS_KEY

# One worker for the module: every golden case goes through the CLI once.
# Its shared fixtures are session ones (tests/conftest.py says why).
pytestmark = pytest.mark.xdist_group("webhook-cli")

FIXTURES = Path(__file__).parent / "testdata" / "fixtures"
OFFLINE = [c for c in discover() if c.offline]


def _run_case(case: Case) -> subprocess.CompletedProcess[str]:
    args = ["inject", "-f", str(case.input_path)]
    if case.config_path is not None:
        args += ["--config", str(case.config_path)]
    return jitckpt(*args)


@pytest.fixture(scope="session")
def case_runs() -> dict[str, subprocess.CompletedProcess[str]]:
    """Every offline golden case through the CLI, a few at a time."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip([c.name for c in OFFLINE], pool.map(_run_case, OFFLINE), strict=True))


@pytest.mark.parametrize("case", OFFLINE, ids=[c.name for c in OFFLINE])
def test_cli_matches_the_same_goldens(
    case: Case, case_runs: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    run = case_runs[case.name]
    expected = case.expected_result()
    invalid = expected["skip_reason"] == SKIP_INVALID_SETTING
    assert run.returncode == (1 if invalid else 0), run.stderr
    out = documents(run.stdout)
    source = documents(case.input_path.read_text())
    assert [d["kind"] for d in out] == [d["kind"] for d in source]
    for before, after in zip(source, out, strict=True):
        if before["kind"] != "Pod":
            assert after == before
    (pod,) = [d for d in out if d["kind"] == "Pod"]
    check_pod(case, pod)
    if not expected["injected"]:
        assert f"not injected ({expected['skip_reason']})" in run.stderr
        assert expected["message"] in run.stderr
    for warning in expected["warnings"]:
        assert warning in run.stderr


def test_invalid_setting_names_key_and_rule_on_stderr() -> None:
    case = {c.name: c for c in OFFLINE}["invalid-settings"]
    run = jitckpt("inject", "-f", str(case.input_path))
    assert run.returncode == 1
    assert 'jitckpt.io/save-steps="0" (from pod annotation) is invalid: must be an integer' in (
        run.stderr
    )
    assert "jitckpt.io/grace-period-seconds" in run.stderr
    assert "'..'" in run.stderr
    assert STATUS_KEY not in run.stdout


def test_namespace_and_pod_piped_through_stdin() -> None:
    ns, pod = FIXTURES / "namespace-team-a.yaml", FIXTURES / "pytorchjob-master.yaml"
    run = subprocess.run(
        f"cat '{ns}' '{pod}' | '{jitckpt.__globals__['JITCKPT']}' inject -f -",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    out = documents(run.stdout)
    assert [d["kind"] for d in out] == ["Namespace", "Pod"]
    injected = out[1]
    assert injected["spec"]["initContainers"][0]["name"] == "jitckpt-agent"
    env = {e["name"]: e for e in injected["spec"]["initContainers"][0]["env"]}
    assert env["JITCKPT_DESTINATION"]["value"] == "s3://ml-checkpoints/team-a/team-a/bert-ft"


def test_without_namespace_settings_the_pod_is_unchanged_and_the_reason_given() -> None:
    """Unchanged but for the reason annotation, as the webhook marks it."""
    pod_text = (FIXTURES / "pytorchjob-master.yaml").read_text()
    run = jitckpt("inject", "-f", "-", stdin=pod_text)
    assert run.returncode == 0
    (out,) = documents(run.stdout)
    reason = out["metadata"]["annotations"].pop("jitckpt.io/reason")
    assert reason.startswith("no-destination: no jitckpt.io/destination")
    if not out["metadata"]["annotations"]:
        del out["metadata"]["annotations"]
    assert [out] == documents(pod_text)
    assert "not injected (no-destination)" in run.stderr


def test_namespace_file_supplies_settings(tmp_path: Path) -> None:
    run = jitckpt(
        "inject",
        "-f",
        str(FIXTURES / "trainjob-node.yaml"),
        "--namespace-file",
        str(FIXTURES / "namespace-team-b.yaml"),
    )
    assert run.returncode == 0, run.stderr
    (pod,) = documents(run.stdout)
    assert STATUS_KEY in pod["metadata"]["annotations"]
    assert pod["metadata"]["generateName"] == "llama-sft-node-0-1-"


def test_list_items_are_injected_in_place() -> None:
    master = load_yaml(FIXTURES / "pytorchjob-master.yaml")
    plain = load_yaml(FIXTURES / "plain-pod.yaml")
    ns = load_yaml(FIXTURES / "namespace-team-a.yaml")
    listing = {"apiVersion": "v1", "kind": "List", "items": [ns, master, plain]}
    run = jitckpt("inject", "-f", "-", stdin=documents_text([listing]))
    assert run.returncode == 0, run.stderr
    (out,) = documents(run.stdout)
    assert out["kind"] == "List"
    items = out["items"]
    assert items[0] == ns and items[2] == plain
    assert STATUS_KEY in items[1]["metadata"]["annotations"]
    assert "pod/team-a/notebook-0: not injected (not-trainer)" in run.stderr


def documents_text(docs: list[Any]) -> str:
    import yaml

    return yaml.safe_dump_all(docs)


@pytest.mark.parametrize("path", cli_cases(), ids=[p.name for p in cli_cases()])
def test_whole_command_goldens(path: Path, update_golden: bool) -> None:
    run = jitckpt("inject", "-f", str(path))
    assert run.returncode == 0, run.stderr
    name = path.name.removesuffix(".in.yaml")
    check_text(CLI_DIR / f"{name}.out.yaml", run.stdout, update_golden)
    check_text(CLI_DIR / f"{name}.stderr", run.stderr, update_golden)


def test_pytorchjob_templates_become_valid_injected_pods() -> None:
    run = jitckpt("inject", "-f", str(CLI_DIR / "pytorchjob.in.yaml"))
    assert run.returncode == 0, run.stderr
    ns, job, service = documents(run.stdout)
    source = documents((CLI_DIR / "pytorchjob.in.yaml").read_text())
    assert ns == source[0] and service == source[2]
    for replica_type, replica in job["spec"]["pytorchReplicaSpecs"].items():
        template = replica["template"]
        # No controller labels leak into the template; the env the controller sets is left to it.
        labels = template["metadata"].get("labels") or {}
        assert not any(k.startswith("training.kubeflow.org/") for k in labels), labels
        trainer = template["spec"]["containers"][0]
        assert not {"PET_NNODES", "PET_NODE_RANK"} & {e["name"] for e in trainer["env"]}
        agent = template["spec"]["initContainers"][0]
        env = {e["name"]: e.get("value") for e in agent["env"]}
        assert env["JITCKPT_NNODES"] == "4"
        assert env["JITCKPT_DESTINATION"] == "s3://ml-checkpoints/team-a/team-a/llama-ft"
        pod = {"apiVersion": "v1", "kind": "Pod", **template}
        pod["metadata"] = {**template["metadata"], "name": "x"}
        kv.validate(pod, "1.29", strict=True)
        # Each pod the controller creates from the template: its sidecar's node is the
        # node the controller numbers it (master 0, worker i -> i + 1), never a guess.
        for index in range(replica.get("replicas", 1)):
            ranks = sidecar_and_controller_ranks(template, replica_type, index)
            assert ranks == (index + (replica_type == "Worker"),) * 2
    assert "Worker: note: each worker's sidecar takes its node rank" in run.stderr


def sidecar_and_controller_ranks(
    template: dict[str, Any], replica_type: str, index: int
) -> tuple[int, int]:
    """The sidecar's node rank (env resolved as the kubelet would) and the controller's RANK."""
    labels = {
        **(template["metadata"].get("labels") or {}),
        "training.kubeflow.org/replica-type": replica_type.lower(),
        "training.kubeflow.org/replica-index": str(index),
    }
    pod = PodContext(metadata={**template["metadata"], "labels": labels}, spec={}, pod_ip="")
    agent = template["spec"]["initContainers"][0]
    secrets = ObjectStore(secrets={"team-a-s3": {}})
    config = AgentConfig.from_env(container_env(agent, pod, secrets))
    controller_rank = index + 1 if replica_type == "Worker" else 0  # training-operator v1.9
    return config.node_rank, controller_rank


def test_an_elastic_pytorchjob_is_not_injected_offline(tmp_path: Path) -> None:
    """elasticPolicy: node count a range, ranks from the rendezvous: unchanged, reason given."""
    source = documents((CLI_DIR / "pytorchjob.in.yaml").read_text())
    job = source[1]
    job["spec"]["elasticPolicy"] = {"minReplicas": 1, "maxReplicas": 4, "rdzvBackend": "c10d"}
    run = jitckpt("inject", "-f", "-", stdin=documents_text(source))
    assert run.returncode == 0, run.stderr
    assert documents(run.stdout)[1] == job
    assert run.stderr.count("not injected (unknown-nodes)") == 2


def test_trainjob_is_left_alone_and_says_why() -> None:
    run = jitckpt("inject", "-f", str(CLI_DIR / "trainjob.in.yaml"))
    assert run.returncode == 0
    assert documents(run.stdout) == documents((CLI_DIR / "trainjob.in.yaml").read_text())
    assert "TrainJobs are injected at admission only" in run.stderr


@pytest.mark.parametrize(
    ("args", "stdin", "needle"),
    [
        (["-f", "/nonexistent/pod.yaml"], None, "No such file"),
        (["-f", "-"], "kind: Pod\nmetadata: [unclosed\n", "not valid YAML"),
        (["-f", "-", "--config", "/nonexistent/config.yaml"], "", "cannot read"),
    ],
)
def test_bad_input_exits_2(args: list[str], stdin: str | None, needle: str) -> None:
    run = jitckpt("inject", *args, stdin=stdin)
    assert run.returncode == 2
    assert needle in run.stderr
    assert "Traceback" not in run.stderr


def test_bad_config_key_is_reported(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("defaults:\n  retention: 3\n")
    run = jitckpt("inject", "-f", "-", "--config", str(config), stdin="")
    assert run.returncode == 2
    assert "unknown setting 'retention' in defaults" in run.stderr


def test_help_lists_every_setting() -> None:
    from webhook.settings import SETTINGS

    run = jitckpt("inject", "--help")
    assert run.returncode == 0
    for setting in SETTINGS.values():
        assert setting.key in run.stdout

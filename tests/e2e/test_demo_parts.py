"""The demo's own parts, without training: generated pods, the weights comparison."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from local.demo.jobpods import JobSpec
from local.demo.jobrun import job_pods
from local.demo.scenario import DemoOptions, open_scenario
from local.demo.weights import compare_files
from local.podrunner import ObjectStore
from local.podrunner.spec import PodContext, container_env
from webhook.config import WebhookConfig
from webhook.jobs import PYTORCHJOB, TRAINJOB, TrainerPod, detect
from webhook.mutate import NamespaceInfo, mutate

FIXTURES = Path(__file__).parents[1] / "webhook" / "testdata" / "fixtures"
NAMESPACE = NamespaceInfo(
    "ns", {"jitckpt.io/injection": "enabled"}, {"jitckpt.io/destination": "pvc://c/p"}
)


def job(kind: str, nnodes: int = 3) -> JobSpec:
    return JobSpec(
        "bert",
        "ns",
        nnodes=nnodes,
        nproc_per_node=2,
        command=["torchrun", "t.py"],
        master_port=29555,
        kind=kind,
        env={"USER_SETTING": "1"},
        working_dirs=[f"/w/node-{rank}" for rank in range(nnodes)],
    )


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    """The trainer's env as the kubelet resolves it (fieldRefs from the pod's metadata)."""
    metadata = {"name": "pod", **pod["metadata"]}
    context = PodContext(metadata=metadata, spec=pod["spec"], pod_ip="127.0.0.1")
    return container_env(pod["spec"]["containers"][0], context, ObjectStore())


def test_pytorchjob_pods_look_like_the_training_operators_and_get_injected() -> None:
    pods = job_pods(job(PYTORCHJOB))
    assert [p["metadata"]["name"] for p in pods] == [
        "bert-master-0",
        "bert-worker-0",
        "bert-worker-1",
    ]
    for rank, pod in enumerate(pods):
        env = env_of(pod)
        assert env["PET_NODE_RANK"] == env["RANK"] == str(rank)
        assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == ("3", "2")
        assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] == "29555"
        assert env["USER_SETTING"] == "1"
        assert pod["spec"]["containers"][0]["workingDir"] == f"/w/node-{rank}"
        trainer = detect(pod)
        assert isinstance(trainer, TrainerPod) and trainer.job_name == "bert"
        assert trainer.kind == PYTORCHJOB
    result = mutate(pods[1], NAMESPACE, WebhookConfig())
    assert result.injected, result.message


def test_trainjob_pods_look_like_trainer_v2_and_jobsets_and_get_injected() -> None:
    pods = job_pods(job(TRAINJOB))
    for index, pod in enumerate(pods):
        metadata, spec = pod["metadata"], pod["spec"]
        assert metadata["generateName"] == f"bert-node-0-{index}-" and "name" not in metadata
        assert spec["subdomain"] == "bert" and spec["hostname"] == f"bert-node-0-{index}"
        assert spec["containers"][0]["name"] == "node"
        assert metadata["annotations"]["batch.kubernetes.io/job-completion-index"] == str(index)
        env = env_of(pod)
        # torchrun reads PET_*; the node rank comes from the completion index annotation
        assert env["PET_NODE_RANK"] == env["JOB_COMPLETION_INDEX"] == str(index)
        assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == ("3", "2")
        assert (env["PET_MASTER_ADDR"], env["PET_MASTER_PORT"]) == ("127.0.0.1", "29555")
        assert "RANK" not in env and "WORLD_SIZE" not in env  # PyTorchJob's, not TrainJob's
        trainer = detect(pod)
        assert isinstance(trainer, TrainerPod), trainer
        assert (trainer.kind, trainer.job_name) == (TRAINJOB, "bert")
        result = mutate(pod, NAMESPACE, WebhookConfig())
        assert result.injected, result.message
        agent = result.pod["spec"]["initContainers"][-1]
        copied = {e["name"]: e for e in agent["env"]}["JITCKPT_NODE_RANK"]
        assert copied["valueFrom"]["fieldRef"]["fieldPath"].endswith(
            "['batch.kubernetes.io/job-completion-index']"
        )


@pytest.mark.parametrize(
    ("kind", "fixture", "rank"),
    [(PYTORCHJOB, "pytorchjob-worker.yaml", 2), (TRAINJOB, "trainjob-node.yaml", 1)],
)
def test_generated_pods_carry_what_the_controllers_give_real_ones(
    kind: str, fixture: str, rank: int
) -> None:
    """Every label, annotation and env name of a pod captured from a cluster, and its shape."""
    real = yaml.safe_load((FIXTURES / fixture).read_text())
    ours = job_pods(job(kind))[rank]
    for part in ("labels", "annotations"):
        mine = set(ours["metadata"].get(part) or {})
        theirs = {k for k in real["metadata"].get(part) or {} if not k.startswith("jitckpt.io/")}
        assert theirs <= mine, (part, theirs - mine)
    real_trainer, our_trainer = real["spec"]["containers"][0], ours["spec"]["containers"][0]
    assert our_trainer["name"] == real_trainer["name"]
    assert {e["name"] for e in real_trainer["env"]} <= {e["name"] for e in our_trainer["env"]}
    assert ours["spec"]["restartPolicy"] == real["spec"]["restartPolicy"]
    assert ("subdomain" in ours["spec"]) == ("subdomain" in real["spec"])
    [owner], [real_owner] = ours["metadata"]["ownerReferences"], real["metadata"]["ownerReferences"]
    assert (owner["apiVersion"], owner["kind"]) == (real_owner["apiVersion"], real_owner["kind"])


def test_weights_are_compared_bit_for_bit(tmp_path: Path) -> None:
    base = {"w": torch.tensor([0.0, 1.0]), "n": torch.tensor([float("nan")])}
    same = {"w": torch.tensor([0.0, 1.0]), "n": torch.tensor([float("nan")])}
    signed = {"w": torch.tensor([-0.0, 1.0]), "n": torch.tensor([float("nan")])}
    for name, state in (("a", base), ("b", same), ("c", signed)):
        torch.save(state, tmp_path / f"{name}.pt")
    assert compare_files(tmp_path / "a.pt", tmp_path / "b.pt").equal  # NaN == NaN bitwise
    differ = compare_files(tmp_path / "a.pt", tmp_path / "c.pt")  # -0.0 != 0.0 bitwise
    assert not differ.equal and differ.differing == ["w"]
    torch.save({"w": base["w"]}, tmp_path / "d.pt")
    assert compare_files(tmp_path / "a.pt", tmp_path / "d.pt").differing == ["n"]


def test_every_pod_of_one_demo_gets_one_hash_seed_and_each_demo_its_own(tmp_path: Path) -> None:
    """Both runs' pods run on the scenario's one node, whose image env carries the seed: a
    set's order (PEFT's ``target_modules``) then matches between the runs of one demo."""
    seeds = []
    for name in ("a", "b"):
        options = DemoOptions(workdir=tmp_path / name)
        with open_scenario(options, io.StringIO()) as scenario:
            first = scenario.node.base_env("local/trainer:latest")["PYTHONHASHSEED"]
            again = scenario.node.base_env("other/image:1")["PYTHONHASHSEED"]
        assert first == again and first.isdigit() and 0 < int(first) < 2**32
        seeds.append(first)
    assert seeds[0] != seeds[1]

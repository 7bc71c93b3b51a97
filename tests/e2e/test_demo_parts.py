"""The demo's own parts, without training: generated pods, the weights comparison."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from local.demo.jobpods import JobSpec, job_pods
from local.demo.weights import compare_files
from webhook.config import WebhookConfig
from webhook.jobs import TrainerPod, detect
from webhook.mutate import NamespaceInfo, mutate


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    container = pod["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"]}


def test_pods_look_like_the_training_operators_and_get_injected() -> None:
    job = JobSpec(
        "bert", "ns", nnodes=3, nproc_per_node=2, command=["torchrun", "t.py"], master_port=29555
    )
    pods = job_pods(job)
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
        assert pod["metadata"]["labels"]["training.kubeflow.org/job-name"] == "bert"
        trainer = detect(pod)
        assert isinstance(trainer, TrainerPod) and trainer.job_name == "bert"
    namespace = NamespaceInfo(
        "ns", {"jitckpt.io/injection": "enabled"}, {"jitckpt.io/destination": "pvc://c/p"}
    )
    result = mutate(pods[1], namespace, WebhookConfig())
    assert result.injected, result.message


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

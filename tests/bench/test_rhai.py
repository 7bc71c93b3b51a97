"""The OpenShift AI subject's plumbing (bench/rhai.py), without a checkout of the peer.

A stand-in checkout of three small files takes the peer's place: what matters here is
that the bench finds a checkout or says it is absent, assembles the pod's script with
the checkout's own codegen, and reads the store as the peer's resume does.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from bench import rhai

CONSTANTS = 'CHECKPOINT_INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"\n'
INSTRUMENTATION = textwrap.dedent(
    '''
    def _create_checkpoint_instrumentation(checkpoint_config: dict) -> tuple:
        """Stand-in: the real one patches Trainer.__init__."""
        return None, None, lambda: None, lambda: None
    '''
)
# The shape of the SDK's codegen: the function's source, the constants import inside it.
CODEGEN = textwrap.dedent(
    """
    import inspect
    import textwrap

    from kubeflow_trainer_api import models  # the SDK's client side: never imported


    def get_jit_checkpoint_injection_code(
        output_dir=None,
        cloud_remote_storage_uri=None,
        periodic_checkpoint_config=None,
        enable_jit_checkpoint=False,
        verify_cloud_storage_access=True,
        verify_cloud_storage_ssl=True,
    ):
        from kubeflow.trainer.rhai.constants import CHECKPOINT_INCOMPLETE_MARKER

        body = textwrap.dedent(inspect.getsource(_create_checkpoint_instrumentation))
        config = {
            "enable_jit": enable_jit_checkpoint,
            "output_dir": output_dir,
            "cloud_remote_storage_uri": cloud_remote_storage_uri,
            **periodic_checkpoint_config,
        }
        header = (
            f"MARKER = {CHECKPOINT_INCOMPLETE_MARKER!r}\\n{body}\\n"
            f"checkpoint_config = {config!r}\\n"
        )
        return header, "FOOTER_RAN = True\\n"
    """
)


def fake_checkout(root: Path) -> Path:
    package = root / rhai.PACKAGE
    (package / "instrumentation").mkdir(parents=True)
    (root / rhai.CONSTANTS_MODULE).write_text(CONSTANTS)
    (root / rhai.CHECKPOINT_MODULE).write_text(INSTRUMENTATION)
    (root / rhai.CODEGEN_MODULE).write_text(CODEGEN)
    return root


def test_absent_without_a_path_or_env() -> None:
    assert rhai.checkout_from(None, env={}) is None
    with pytest.raises(rhai.Absent, match="no checkout"):
        rhai.check_checkout(None)


def test_path_from_the_flag_before_the_env(tmp_path: Path) -> None:
    env = {rhai.ENV_PATH: "/from/env"}
    assert rhai.checkout_from(str(tmp_path), env) == tmp_path
    assert rhai.checkout_from(None, env) == Path("/from/env")
    assert rhai.checkout_from(None, {rhai.ENV_PATH: ""}) is None


def test_a_directory_without_the_sdk_is_absent(tmp_path: Path) -> None:
    with pytest.raises(rhai.Absent, match=r"transformers_checkpoint\.py"):
        rhai.check_checkout(tmp_path)


def test_main_says_absent_and_records_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(rhai.ENV_PATH, raising=False)
    results = tmp_path / "results.json"
    assert rhai.main(["--results", str(results), "--readme", str(tmp_path / "README.md")]) == 0
    assert "subject absent, skipped" in capsys.readouterr().err
    assert not results.exists()


def test_script_is_the_codegen_around_the_user_function(tmp_path: Path) -> None:
    checkout = rhai.check_checkout(fake_checkout(tmp_path / "sdk"))
    output = tmp_path / "out"
    text = rhai.script(
        checkout, ["--max-steps", "7"], output, "s3://b/p", rhai.Periodic("steps", 7)
    )
    header, rest = text.split("def train_bench_workload", 1)
    assert "MARKER = 'checkpoint-is-incomplete.txt'" in header
    assert "def _create_checkpoint_instrumentation" in header
    assert "'save_strategy': 'steps'" in header and "'save_steps': 7" in header
    assert f"'output_dir': '{output}'" in header
    assert "'cloud_remote_storage_uri': 's3://b/p'" in header
    assert "['bench.workload', '--max-steps', '7']" in rest
    assert rest.index("train_bench_workload()") < rest.index("FOOTER_RAN")
    namespace: dict[str, object] = {}
    exec(compile(header, "header", "exec"), namespace)  # the header alone runs
    assert namespace["checkpoint_config"] == {
        "enable_jit": True,
        "output_dir": str(output),
        "cloud_remote_storage_uri": "s3://b/p",
        "save_strategy": "steps",
        "save_steps": 7,
        "save_total_limit": 3,
    }


def test_complete_step_is_what_the_peers_resume_takes() -> None:
    marker = rhai.INCOMPLETE_MARKER
    keys = [
        "rhai/.kubeflow-access-test",
        "rhai/checkpoint-4/model.safetensors",
        "rhai/checkpoint-4/trainer_state.json",
        "rhai/checkpoint-8/model.safetensors",
        f"rhai/checkpoint-8/{marker}.node-1-rank-0",
        "other/checkpoint-12/model.safetensors",
    ]
    assert rhai.complete_step(keys) == 4
    assert rhai.complete_step(keys, prefix="other") == 12
    assert rhai.complete_step([f"rhai/checkpoint-2/{marker}.node-0-rank-0"]) is None
    assert rhai.complete_step([]) is None


def test_weight_difference(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    base = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    save_file(base, str(tmp_path / "a.safetensors"))
    save_file({k: v.clone() for k, v in base.items()}, str(tmp_path / "same.safetensors"))
    moved = dict(base, b=base["b"] + torch.tensor([0.0, 0.25, 0.0]))
    save_file(moved, str(tmp_path / "moved.safetensors"))
    save_file({"w": base["w"]}, str(tmp_path / "fewer.safetensors"))
    a = tmp_path / "a.safetensors"
    assert rhai.weight_difference(a, tmp_path / "same.safetensors") == 0.0
    assert rhai.weight_difference(a, tmp_path / "moved.safetensors") == 0.25
    assert rhai.weight_difference(a, tmp_path / "fewer.safetensors") == float("inf")


def test_the_peers_marker_name_matches_a_checkout_when_given() -> None:
    checkout = rhai.checkout_from(None)
    if checkout is None:
        pytest.skip(f"no checkout in {rhai.ENV_PATH}")
    constants = rhai._load(checkout / rhai.CONSTANTS_MODULE, "_test_rhai_constants")
    assert constants.CHECKPOINT_INCOMPLETE_MARKER == rhai.INCOMPLETE_MARKER


def test_steady_speed_leaves_out_the_first_step(tmp_path: Path) -> None:
    import json

    from bench import rhai_steady

    path = tmp_path / "timeline.jsonl"
    ends = {1: 100.0, 2: 100.5, 3: 101.0, 4: 102.0}  # step 1 ends after its warm-up
    lines = [{"event": "step_end", "step": s, "t": t, "rank": 0} for s, t in ends.items()]
    lines.append({"event": "step_end", "step": 9, "t": 200.0, "rank": 1})  # another rank's
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert rhai_steady.steps_per_second(path) == 3 / 2.0
    path.write_text(json.dumps(lines[0]) + "\n")
    assert rhai_steady.steps_per_second(path) is None
    assert rhai_steady.steps_per_second(tmp_path / "none.jsonl") is None


def test_committed_step_is_what_jitckpts_resume_takes() -> None:
    from shim import layout
    from sidecar.summary import RECORD_NAME

    record = f"{layout.MANIFEST_DIR}/{RECORD_NAME}"
    keys = [
        f"job/checkpoint-4/{record}",
        "job/checkpoint-4/model.safetensors",
        f"job/checkpoint-8/{layout.MANIFEST_DIR}/node-0.json",  # a node's part, uncommitted
        "job/checkpoint-8/model.safetensors",
        f"other/checkpoint-12/{record}",
        f"job/checkpoint-9/nested/{record}",  # not the checkpoint's own record
    ]
    assert rhai.committed_step(keys, "job") == 4
    assert rhai.committed_step(keys, "other/") == 12
    assert rhai.committed_step(keys[1:4], "job") is None


def test_every_subject_once_a_repetition_none_always_first() -> None:
    runs = list(rhai.rotated(("a", "b", "c"), 4))
    assert [s for rep, s in runs if rep == 0] == ["a", "b", "c"]
    assert [s for rep, s in runs if rep == 1] == ["b", "c", "a"]
    assert [s for rep, s in runs if rep == 3] == ["a", "b", "c"]
    assert len(runs) == 12


def test_the_workers_augmentation_draws_from_the_generator_it_is_given() -> None:
    """The exact case with persistent workers: each sample is changed at random where it is
    loaded, from torch's generator (the one a DataLoader seeds in each worker), so a resume
    is exact only where that generator's state is put back."""
    import torch

    from bench.training_run import ModelShape, workload_argv
    from bench.workload import AUGMENT_SHARE, Augmented

    tokens = torch.randint(0, 8192, (4, 512))
    dataset = Augmented(tokens, 8192)
    torch.manual_seed(1)
    first = dataset[2]["input_ids"]
    torch.manual_seed(1)
    again = dataset[2]["input_ids"]
    other = dataset[2]["input_ids"]
    assert torch.equal(first, again) and not torch.equal(first, other)
    changed = float((first != tokens[2]).float().mean())
    assert 0.3 * AUGMENT_SHARE < changed <= 1.5 * AUGMENT_SHARE
    assert torch.equal(tokens[2], Augmented(tokens, 8192).tokens[2])  # the source is untouched
    shape = ModelShape.for_state("50 MB", 50_000_000)
    argv = workload_argv(shape, Path("out"), Path("t.jsonl"), workers=2)
    assert argv[argv.index("--workers") + 1] == "2"
    assert "--workers" not in workload_argv(shape, Path("out"), Path("t.jsonl"))

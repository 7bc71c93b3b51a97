"""TRL's own RL scripts (``trl/scripts/grpo.py``, ``rloo.py``), unchanged, through the demo.

GRPO and RLOO generate completions for ``steps_per_generation x
num_iterations`` steps at once and keep them in a buffer the Trainer's
checkpoint does not hold (``_buffered_inputs``, indexed by ``_step``). A stop
inside a generation used to resume from a generation made anew; a stop at a
generation's first step was always exact. Each case is one demo with
``--compare``: the resumed run must end bitwise equal to a run never
preempted, in its weights and in what the script saved.

Steps are 1-based; the JIT checkpoint is at the preemption step N, so the
resumed run begins with step N + 1, which is "inside" a generation unless a
generation begins there. The two cases cover both trainers, both knobs that make a
generation span steps (``steps_per_generation 2``, ``num_iterations 2`` with
gradient accumulation), 1 and 2 nodes, one pod and every pod preempted, each
stopped inside a generation (the case that resumed wrongly). A stop at a
generation's first step goes through the same save and put-back
(``tests/shim/test_hidden_state.py``); each demo costs a minute of the suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e import rlfixtures
from tests.e2e.support import demo_summary

pytestmark = pytest.mark.slow

TRL_SCRIPTS = Path(__import__("trl").__file__).parent / "scripts"
MAX_STEPS = 12


@dataclass(frozen=True)
class Case:
    trainer: str  # grpo or rloo
    nnodes: int
    preempt_nodes: str
    step: int  # the preemption step: N + 1 is the first step the resumed run makes
    knobs: tuple[str, ...]
    generation_steps: int  # optimizer steps one generation serves
    first_step: bool  # N + 1 begins a generation

    @property
    def id(self) -> str:
        where = "first-step" if self.first_step else "inside"
        knobs = "-".join(k.lstrip("-") for k in self.knobs[::2])
        return f"{self.trainer}-{self.nnodes}x-{self.preempt_nodes}-{knobs}-{where}"


CASES = [
    Case("grpo", 2, "one", 7, ("--steps_per_generation", "2"), 2, False),
    Case(
        "rloo",
        1,
        "all",
        5,
        ("--num_iterations", "2", "--gradient_accumulation_steps", "2"),
        2,
        False,
    ),
]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> rlfixtures.RLFixtures:
    return rlfixtures.build(tmp_path_factory.mktemp("rl"))


def script_args(case: Case, fx: rlfixtures.RLFixtures) -> list[str]:
    args = ["--model_name_or_path", str(fx.policy), "--reward_model_name_or_path", str(fx.reward)]
    args += ["--dataset_name", str(fx.prompts), "--output_dir", f"{case.trainer}-out"]
    args += ["--max_steps", str(MAX_STEPS), "--per_device_train_batch_size", "4"]
    args += ["--num_generations", "4", "--max_completion_length", "8", "--seed", "3"]
    args += ["--logging_steps", "1", "--report_to", "none", "--use_cpu", *case.knobs]
    return args


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_trl_rl_script_resumes_bitwise_from_a_stop_in_a_generation(
    case: Case, fixtures: rlfixtures.RLFixtures, tmp_path: Path
) -> None:
    assert (case.step % case.generation_steps == 0) is case.first_step  # the case says true
    options = ["--nnodes", str(case.nnodes), "--preempt-at-step", str(case.step)]
    options += ["--preempt-nodes", case.preempt_nodes, "--keep", "--"]
    script = TRL_SCRIPTS / f"{case.trainer}.py"
    summary = demo_summary(script, options + script_args(case, fixtures), tmp_path / "demo")
    context = f"{case.id}: {summary}"
    assert summary["ok"] is True, context
    assert summary["jit_checkpoint_step"] == case.step, context
    assert summary["resumed_from_step"] == case.step, context
    assert summary["final_step"] == MAX_STEPS, context
    assert summary["equal_to_uninterrupted"] is True, context
    logs = "".join(Path(log).read_text() for log in summary["trainer_logs"]["resumed"])
    trainer = {"grpo": "GRPOTrainer", "rloo": "RLOOTrainer"}[case.trainer]
    assert f"{trainer}'s own state is back as it was at the checkpoint (_step, " in logs
    assert "a resume may not continue" not in logs  # TRL's own state is all known

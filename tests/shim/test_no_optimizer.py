"""A training process with no optimizer's step is told it gets no JIT checkpoint, never silent.

pytorch/examples' word_language_model, as its README runs it (no
``--use-optimizer``), updates its parameters by hand. Here the same shape, a
small LSTM language model over slices of a tensor with its hidden state
carried from batch to batch, under the shim with the real sidecar: said once
when it begins to train, in its log and in the sidecar's ``/status`` and
termination message, and again at SIGTERM, which ends it as without jitckpt.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.shim.support import PYTHON, ShimEnv, Spawn, checkpoint_steps, jit_lines
from tests.sidecar.agentproc import AgentProcess

SCRIPT = """
import time
import torch
from torch import nn

torch.manual_seed(0)
data = torch.randint(0, 50, (4000, 4))
embed, rnn, head = nn.Embedding(50, 16), nn.LSTM(16, 16), nn.Linear(16, 50)
params = [*embed.parameters(), *rnn.parameters(), *head.parameters()]
lr, hidden, batch = 1.0, None, 0
for epoch in range(1, 100):
    for i in range(0, data.size(0) - 1, 8):
        source, target = data[i : i + 8], data[i + 1 : i + 9]
        if hidden is not None:
            hidden = tuple(h.detach() for h in hidden)
        output, hidden = rnn(embed(source), hidden)
        loss = nn.functional.cross_entropy(head(output).view(-1, 50), target.reshape(-1))
        for p in params:
            p.grad = None
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.25)
        for p in params:
            p.data.add_(p.grad, alpha=-lr)
        batch += 1
        print("batch", batch, "loss", round(loss.item(), 4), flush=True)
        time.sleep(0.02)
    lr /= 4.0
"""


@pytest.mark.slow
def test_hand_written_sgd_is_told_at_start_and_at_sigterm(
    shim_env: ShimEnv, agent: AgentProcess, spawn: Spawn, tmp_path: Path
) -> None:
    script = tmp_path / "main.py"
    script.write_text(SCRIPT)
    run = spawn([PYTHON, str(script)], shim_env.env)
    run.wait_for("batch 5 ", timeout=120)
    said = [line for line in jit_lines(run.output()) if "gets no JIT checkpoint" in line]
    assert len(said) == 1, run.output()[-3000:]
    assert "it trains with no optimizer" in said[0], said
    agent.wait_for(lambda: agent.status().get("unfollowed") is not None, 30, "the report")
    reason = agent.status()["unfollowed"]
    assert reason.startswith("it trains with no optimizer"), reason
    termination = agent.termination()
    assert termination["unfollowed"] == reason
    assert f"a training process gets no JIT checkpoint: {reason}" in termination["message"]

    run.signal(signal.SIGTERM)
    assert run.wait(timeout=60) == -signal.SIGTERM  # as without jitckpt
    assert run.output().count("SIGTERM: this training process gets no JIT checkpoint") == 1
    assert checkpoint_steps(shim_env.checkpoints) == []

"""The sidecar's own records live where the trainer cannot write (DESIGN 7, "Trust").

They sit beside the shim copy, on the ``jitckpt-shim`` volume: the sidecar
containers mount it writable, every other container of an injected pod only
read-only. These tests pin both halves of that: where the agent puts its
state, and, over every golden injection, how the shim volume is mounted.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from shim import layout
from sidecar.agent import STATE_SUBDIR, Agent
from sidecar.config import AgentConfig
from tests.webhook.golden import Case, discover
from webhook.mutate import mutate
from webhook.status import AGENT, RESTORE, VOL_SHIM

CASES = discover()


def test_the_agents_state_is_on_the_shim_volume_beside_the_shim() -> None:
    agent = Agent(AgentConfig(destination="s3://bucket/ns/job"))
    assert agent.state_dir == Path(layout.SHIM_ROOT) / STATE_SUBDIR
    assert agent.state_dir.parent == Path(layout.SHIM_DIR).parent


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_only_the_sidecar_can_write_the_shim_volume(case: Case) -> None:
    result = mutate(copy.deepcopy(case.pod), case.namespace, case.config, require_opt_in=True)
    if not result.injected:
        # A refused pod stays the user's own (a volume of theirs may carry the name): the
        # webhook only marks why (jitckpt.io/reason), never touches its spec.
        assert all(op["path"].startswith("/metadata/annotations") for op in result.patch)
        assert result.pod["spec"] == case.pod["spec"]
        return
    spec = result.pod["spec"]
    containers = [*spec.get("initContainers", []), *spec.get("containers", [])]
    trainer_mounts = [
        (container["name"], mount)
        for container in containers
        if container["name"] not in (AGENT, RESTORE)
        for mount in container.get("volumeMounts") or []
        if mount.get("name") == VOL_SHIM
    ]
    assert all(mount.get("readOnly") is True for _, mount in trainer_mounts), trainer_mounts
    if result.injected:
        assert trainer_mounts  # the trainer gets the shim, read-only

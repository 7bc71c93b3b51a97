"""A JIT checkpoint every node writes (``Staged.copies``), so that each node's sidecar
uploads a part of its replicated files: the wire fields, which files are replicas and
which node hands over what (``shim/copies.py``), HF's Trainer writing it on every node
(``shim/frameworks/hf/copies.py``), and a 2-node run of a real Trainer under the shim
talking to two real agents (one per node) through recording sockets."""

from __future__ import annotations

import dataclasses
import json
import signal
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from local.ports import free_port
from local.s3server import LocalS3
from shim import copies, dist, layout, protocol
from shim.frameworks.hf import copies as hfcopies
from tests.shim.support import PYTHON, Proc, Recorder, ShimEnv, Spawn, checkpoint_steps
from tests.sidecar.agentproc import AgentProcess
from tests.sidecar.helpers import bucket_objects

# -- the wire -------------------------------------------------------------------------------


def test_copies_and_replicas_go_over_the_wire_and_back() -> None:
    staged = protocol.Staged(
        step=7,
        kind=protocol.KIND_JIT,
        dir="/staging/c7",
        files=("model.safetensors", "rng_state_1.pth", "sub/optimizer.pt"),
        copies=True,
        replicas=("model.safetensors", "sub/optimizer.pt"),
    )
    assert protocol.decode_request(protocol.encode(staged)) == staged
    part = protocol.Staging(
        step=7, kind=protocol.KIND_JIT, dir="/staging/c7", files=("a.pt",), copies=True
    )
    assert protocol.decode_request(protocol.encode(part)) == part
    # Absent from the line when not set, and read back as not set.
    plain = protocol.Staged(step=7, kind=protocol.KIND_JIT, dir="/d", files=("a",))
    assert {"copies", "replicas"}.isdisjoint(plain.to_wire())
    assert protocol.decode_request(protocol.encode(plain)) == plain
    copied = dataclasses.replace(plain, copies=True)  # every node wrote it, no replica found
    assert protocol.decode_request(protocol.encode(copied)) == copied


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"replicas": ["elsewhere.pt"]}, "which files does not list"),
        ({"copies": False}, "replicas needs copies"),
        ({"copies": "yes"}, "copies"),
        ({"replicas": ["a.pt", "a.pt"]}, "twice"),
        ({"replicas": ["../a.pt"]}, "normalized relative path"),
    ],
)
def test_a_staged_with_replicas_it_does_not_list_or_without_copies_is_refused(
    change: dict[str, Any], why: str
) -> None:
    wire = protocol.Staged(
        step=1, kind="jit", dir="/d", files=("a.pt", "b.pt"), copies=True, replicas=("a.pt",)
    ).to_wire()
    wire.update(change)
    with pytest.raises(protocol.ProtocolError, match=why):
        protocol.decode_request(_line(wire))
    part = protocol.Staging(step=1, kind="jit", dir="/d", files=("a",)).to_wire()
    part["copies"] = 1
    with pytest.raises(protocol.ProtocolError, match="copies"):
        protocol.decode_request(_line(part))


def _line(body: dict[str, Any]) -> bytes:
    return (json.dumps(body) + "\n").encode()


# -- which files are replicas, and who hands over what ------------------------------------

NODE0: copies.Listing = (
    ("config.json", 700),
    ("model.safetensors", 4096),
    ("optimizer.pt", 8192),
    ("rng_state_0.pth", 300),
    ("sub/scheduler.pt", 100),
    ("trainer_state.json", 900),
)


def test_replicas_are_the_names_every_node_has_with_one_size() -> None:
    node1 = (
        ("config.json", 700),
        ("model.safetensors", 4096),
        ("optimizer.pt", 8192),
        ("rng_state_1.pth", 300),
        ("sub/scheduler.pt", 100),
        ("trainer_state.json", 901),  # says it is not the world's first process
    )
    node2 = tuple(entry for entry in node1 if entry[0] != "sub/scheduler.pt")  # missing
    node2 = (*node2, ("rng_state_2.pth", 300))
    assert copies.replicas([NODE0, node1]) == (
        "config.json",
        "model.safetensors",
        "optimizer.pt",
        "sub/scheduler.pt",
    )
    shared = copies.replicas([NODE0, node1, node2])
    assert shared == ("config.json", "model.safetensors", "optimizer.pt")
    # Node 0 hands over all it has; a higher node the replicas and what no lower node has:
    # its trainer_state.json is another size than node 0's, its scheduler no replica.
    listings = [NODE0, node1, node2]
    assert copies.handed_by(listings, 0, shared) == tuple(name for name, _ in NODE0)
    assert copies.handed_by(listings, 1, shared) == (*shared, "rng_state_1.pth")
    assert copies.handed_by(listings, 2, shared) == (*shared, "rng_state_2.pth")
    # A name only higher nodes have goes to the lowest of them.
    extra = [NODE0, (*node1, ("late.pt", 5)), (*node2, ("late.pt", 5))]
    assert "late.pt" in copies.handed_by(extra, 1, shared)
    assert "late.pt" not in copies.handed_by(extra, 2, shared)
    assert copies.replicas([]) == ()
    assert copies.replicas([NODE0]) == tuple(name for name, _ in NODE0)
    assert copies.replicas([(("link", -1),), (("link", -1),)]) == ()  # no regular file


def test_a_listing_names_every_file_with_its_size(tmp_path: Path) -> None:
    (tmp_path / "sub" / "deep").mkdir(parents=True)
    (tmp_path / "a.pt").write_bytes(b"x" * 10)
    (tmp_path / "sub" / "deep" / "b.json").write_bytes(b"{}")
    (tmp_path / "link").symlink_to(tmp_path / "a.pt")
    assert copies.listing(str(tmp_path)) == (("a.pt", 10), ("link", -1), ("sub/deep/b.json", 2))


def _rank(monkeypatch: pytest.MonkeyPatch, rank: int, local_rank: int = 0) -> None:
    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", 2)):
        monkeypatch.setenv(name, str(value))


def test_when_the_nodes_cannot_compare_no_file_is_a_replica_and_node_0s_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A failed gather: node 0 hands over every file; a higher node its ranks' own only (its
    copies of node 0's files may differ: two nodes may not list one name with other bytes)."""
    for name in ("model.safetensors", "trainer_state.json", "rng_state_1.pth"):
        (tmp_path / name).write_text(name)

    def broken(value: object) -> list[object]:
        raise RuntimeError("the group is gone")

    monkeypatch.setattr(dist, "all_gather_object", broken)
    _rank(monkeypatch, 1)
    assert copies.plan(str(tmp_path), hfcopies.COPIES) == copies.Plan(("rng_state_1.pth",), ())
    assert "could not compare the files" in capsys.readouterr().err
    _rank(monkeypatch, 0)
    assert copies.plan(str(tmp_path), hfcopies.COPIES) == copies.Plan(None, ())
    # Without a process group every file is this one node's, and a replica of itself.
    monkeypatch.undo()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert copies.plan(str(tmp_path), hfcopies.COPIES) == copies.Plan(
        ("model.safetensors", "rng_state_1.pth", "trainer_state.json"),
        ("model.safetensors", "rng_state_1.pth", "trainer_state.json"),
    )


def test_a_ranks_own_files_are_hfs_random_states_and_the_shims_records() -> None:
    own = ["rng_state_0.pth", "rng_state_17.pth", "jitckpt_data_3.pth", "jitckpt_trainer_12.pth"]
    own.append("jitckpt_books_2.pth")
    assert all(hfcopies.rank_file(name) for name in own)
    others = ["rng_state.pth", "model.safetensors", "trainer_state.json", "optimizer.pt"]
    assert not any(hfcopies.rank_file(name) for name in others)


# -- HF's switch ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FrozenArgs:
    """Arguments that refuse assignment, as some transformers versions made theirs."""

    save_on_each_node: bool = False
    output_dir: str = "out"


def test_each_node_sets_hfs_switch_for_the_save_only_and_pickles_the_users_args(
    tmp_path: Path,
) -> None:
    trainer = SimpleNamespace(args=FrozenArgs())
    seen: list[bool] = []

    def save() -> str:
        seen.append(trainer.args.save_on_each_node)
        torch.save(trainer.args, tmp_path / "training_args.bin")  # as HF's _save does
        torch.save({"w": 1}, tmp_path / "other.pt")
        seen.append(trainer.args.save_on_each_node)
        return "saved"

    original = torch.save
    assert hfcopies.each_node(trainer, save)() == "saved"
    assert seen == [True, True]
    assert trainer.args.save_on_each_node is False
    assert torch.save is original
    pickled = torch.load(tmp_path / "training_args.bin", weights_only=False)
    assert pickled.save_on_each_node is False

    def failing() -> None:
        assert trainer.args.save_on_each_node is True
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        hfcopies.each_node(trainer, failing)()
    assert trainer.args.save_on_each_node is False and torch.save is original


def test_only_a_replicated_model_on_several_nodes_is_written_by_every_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def trainer(**attributes: object) -> SimpleNamespace:
        args = SimpleNamespace(
            save_on_each_node=False, parallel_mode=SimpleNamespace(value="distributed")
        )
        return SimpleNamespace(args=args, model=torch.nn.Linear(2, 2), **attributes)

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert hfcopies.spread(trainer())
    assert not hfcopies.spread(trainer(is_deepspeed_enabled=True))
    assert not hfcopies.spread(trainer(is_fsdp_enabled=True))
    assert not hfcopies.spread(trainer(is_distributed_loading_by_transformers=True))
    config = SimpleNamespace(dp_shard_size=1, tp_size=2, cp_size=1, sp_size=1)
    assert not hfcopies.spread(trainer(accelerator=SimpleNamespace(parallelism_config=config)))
    config = SimpleNamespace(dp_shard_size=1, tp_size=1, cp_size=1, sp_size=1)
    assert hfcopies.spread(trainer(accelerator=SimpleNamespace(parallelism_config=config)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one node
    assert not hfcopies.spread(trainer())
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # unknown: as one node
    assert not hfcopies.spread(trainer())


# -- two nodes, a real Trainer, real agents -----------------------------------------------

SAVE_FLAG_SCRIPT = """
import os, sys
from transformers import TrainerCallback
from local.demo import train_tiny

class SaveFlag(TrainerCallback):
    # Runs before the shim's own on_save (which stages the JIT checkpoint and exits).
    def on_save(self, args, state, control, **kwargs):
        print(f"rank {os.environ['RANK']} saved {state.global_step}: "
              f"each node {args.save_on_each_node}, should_save {args.should_save}", flush=True)

original = train_tiny.make_callbacks
train_tiny.make_callbacks = lambda sleep: [*original(sleep), SaveFlag()]
sys.exit(train_tiny.main())
"""


# The sidecars' smallest piece: the tiny model's weights and optimizer state are split.
PIECE_MIN_SIZE = 64 * 1024


def _node_agent(root: Path, bucket: str, node: int, local_s3: LocalS3) -> AgentProcess:
    return AgentProcess(
        root=root,
        destination=f"s3://{bucket}/ns-a/job-1",
        s3_env=local_s3.credentials_env(),
        extra_env={
            layout.ENV_GRACE_SECONDS: "60",
            layout.ENV_NODE_RANK: str(node),
            layout.ENV_NNODES: "2",
            layout.ENV_POD_NAME: f"job-1-worker-{node}",
            layout.ENV_PIECE_MIN_SIZE: str(PIECE_MIN_SIZE),
        },
    )


@pytest.mark.slow
def test_two_nodes_each_write_the_jit_checkpoint_and_hand_over_their_part(
    tmp_path: Path, spawn: Spawn, local_s3: LocalS3
) -> None:
    """One process per node, gloo: the JIT save writes HF's files on both nodes, node 0's as
    without copies; each node's ``staged`` says copies and the same replicas, a rank's
    random states are none, and node 1 leaves out its ``trainer_state.json`` (another size:
    it is not the world's first process). The sidecars commit it, node 1 having uploaded a
    piece of each large replica. Periodic saves stay rank 0's, and HF's switch is set back
    before the callbacks of the JIT save run."""
    script = tmp_path / "save_flag.py"
    script.write_text(SAVE_FLAG_SCRIPT)
    bucket = f"copies-{uuid.uuid4().hex[:12]}"
    local_s3.create_bucket(bucket)
    port = free_port()
    nodes: list[tuple[ShimEnv, AgentProcess, Recorder]] = []
    runs: list[Proc] = []
    for node in (0, 1):
        env = ShimEnv(tmp_path / f"node{node}")
        agent = _node_agent(env.root, bucket, node, local_s3)
        agent.start()
        nodes.append((env, agent, Recorder(env.run / "recorded.sock", agent.socket)))
    try:
        for node, (env, agent, _) in enumerate(nodes):
            agent.wait_ready()
            ranks = {
                "RANK": node,
                "LOCAL_RANK": 0,
                "WORLD_SIZE": 2,
                "LOCAL_WORLD_SIZE": 1,
                "GROUP_RANK": node,
                "GROUP_WORLD_SIZE": 2,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }
            process_env = dict(env.env, JITCKPT_SOCKET=str(env.run / "recorded.sock"))
            process_env.update({name: str(value) for name, value in ranks.items()})
            args = ["--output-dir", str(tmp_path / "out"), "--max-steps", "60"]
            args += ["--save-steps", "2", "--step-sleep", "0.3"]
            runs.append(spawn([PYTHON, str(script), *args], process_env))
        runs[0].wait_for("rank 0 step 5/", timeout=180)
        runs[1].signal(signal.SIGTERM)  # one node preempted: both stop at one step
        codes = [run.wait(timeout=120) for run in runs]
        assert codes == [143, 143], [run.output()[-3000:] for run in runs]
        step = int(runs[0].output().split("stopping at step ")[1].split()[0])
        for _, agent, _ in nodes:  # both sidecars committed their part of it
            agent.wait_for(lambda a=agent: a.committed_step() == step, 90, "the JIT commit")
        objects = bucket_objects(local_s3, bucket)
    finally:
        for _, agent, recorder in nodes:
            recorder.close()
            agent.kill()

    sent = [recorder.requests() for _, _, recorder in nodes]
    jits = [
        [r for r in mine if isinstance(r, protocol.Staged) and r.kind == "jit"] for mine in sent
    ]
    assert [len(j) for j in jits] == [1, 1], sent
    staged0, staged1 = jits[0][0], jits[1][0]
    assert staged0.step == staged1.step == step
    dirs = [env.checkpoints / f"checkpoint-{step}" for env, _, _ in nodes]
    names = [sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()) for d in dirs]

    # Both nodes wrote HF's files; the ranks' random states are each node's own.
    hf_files = {"model.safetensors", "optimizer.pt", "scheduler.pt", "training_args.bin"}
    assert hf_files | {"trainer_state.json", "rng_state_0.pth"} <= set(names[0])
    assert hf_files | {"trainer_state.json", "rng_state_1.pth"} <= set(names[1])
    assert "rng_state_1.pth" not in names[0] and "rng_state_0.pth" not in names[1]

    # The same replicas on both, said with copies; node 0 lists every file it has.
    assert staged0.copies and staged1.copies
    assert staged0.replicas == staged1.replicas
    replicas = set(staged0.replicas)
    assert hf_files <= replicas
    assert not any(name.startswith(("rng_state_", "jitckpt_")) for name in replicas)
    assert "trainer_state.json" not in replicas
    assert sorted(staged0.files) == names[0]
    assert set(staged1.files) == replicas | {n for n in names[1] if n not in names[0]}
    assert "trainer_state.json" not in staged1.files and "rng_state_1.pth" in staged1.files
    for name in replicas:
        assert (dirs[0] / name).stat().st_size == (dirs[1] / name).stat().st_size
    # The streamed parts said copies too.
    for mine in sent:
        parts = [r for r in mine if isinstance(r, protocol.Staging) and r.step == step]
        assert parts and all(part.copies for part in parts), mine

    # What the sidecars committed: node 0 lists every replica, made of pieces of which
    # node 1 uploaded its own; node 1 lists its rank's files alone.
    root = f"ns-a/job-1/checkpoint-{step}/.jitckpt"
    manifests = [json.loads(objects[f"{root}/node-{node}.json"]) for node in (0, 1)]
    listed = [{entry["path"]: entry for entry in m["files"]} for m in manifests]
    assert set(listed[0]) == set(names[0])
    assert set(listed[1]) == set(staged1.files) - replicas
    for name in ("model.safetensors", "optimizer.pt"):  # large enough to be split
        assert [p["node"] for p in listed[0][name].get("pieces", [])] == [0, 1], listed[0][name]
    assert not any(key.startswith(f"{root}/torn") for key in objects)

    # Node 0's checkpoint is what HF writes without copies: the periodic ones' files, and
    # the arguments as the user set them.
    periodic = [s for s in checkpoint_steps(nodes[0][0].checkpoints) if s != step]
    assert periodic
    before = nodes[0][0].checkpoints / f"checkpoint-{periodic[-1]}"
    assert sorted(p.name for p in before.iterdir()) == names[0]
    assert (before / "training_args.bin").read_bytes() == (
        dirs[0] / "training_args.bin"
    ).read_bytes()
    for d in dirs:
        args = torch.load(d / "training_args.bin", weights_only=False)
        assert args.save_on_each_node is False
    # Node 1's periodic checkpoints hold its rank's files only.
    for earlier in periodic:
        held = {p.name for p in (nodes[1][0].checkpoints / f"checkpoint-{earlier}").iterdir()}
        assert held.isdisjoint(hf_files | {"trainer_state.json"}), held
    # HF's switch was set for the JIT save only: set back before its on_save callbacks.
    output = [run.output() for run in runs]
    assert f"rank 1 saved {step}: each node False, should_save False" in output[1]
    assert f"rank 0 saved {step}: each node False, should_save True" in output[0]
    assert f"rank 1 saved {periodic[-1]}: each node False, should_save False" in output[1]

"""The shim's entry point in real interpreters: activation, chaining, pid files, preStop."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shim import layout
from tests.shim.support import PYTHON, REPO, TORCHRUN, ShimEnv, Spawn, jit_lines
from tests.support.tools import unavailable
from webhook.config import WebhookConfig
from webhook.mutate import NamespaceInfo, mutate

PROBE = (
    "import json, os, sys; print(json.dumps({"
    "'active': '_jitckpt_shim' in sys.modules,"
    "'leaked': sorted(n for n in ('protocol', 'layout', 'hf', 'hooks') if n in sys.modules),"
    "'torch': 'torch' in sys.modules,"
    "'pids': sorted(os.listdir(os.environ['PIDS'])) if os.path.isdir(os.environ['PIDS']) else [],"
    "'pid': os.getpid()}))"
)


def probe(env: dict[str, str], pids: Path) -> tuple[dict[str, object], str]:
    done = subprocess.run(
        [PYTHON, "-c", PROBE],
        env={**env, "PIDS": str(pids)},
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout), done.stderr


def test_inactive_without_jitckpt_dir(shim_env: ShimEnv) -> None:
    result, stderr = probe(shim_env.without_shim(), shim_env.pids)
    assert result["active"] is False
    assert result["pids"] == []
    assert stderr == ""


def test_active_registers_pid_privately_and_cheaply(shim_env: ShimEnv) -> None:
    result, stderr = probe(shim_env.env, shim_env.pids)
    assert result["active"] is True
    assert result["pids"] == [f"{result['pid']}.pid"]  # registered while running
    assert result["leaked"] == []  # shim modules are not top-level names
    assert result["torch"] is False  # nothing heavy imported up front
    assert stderr == ""
    assert list(shim_env.pids.iterdir()) == []  # removed at exit


def test_shim_files_never_shadow_user_modules(shim_env: ShimEnv, tmp_path: Path) -> None:
    """A user's config.py/protocol.py later on PYTHONPATH wins over the shim's files."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "config.py").write_text("WHO = 'user config'\n")
    (user / "protocol.py").write_text("WHO = 'user protocol'\n")
    code = "import sys, config, protocol; print(config.WHO, '/', protocol.WHO, '/', sys.path)"
    for base in (shim_env.env, shim_env.without_shim()):
        done = subprocess.run(
            [PYTHON, "-c", code],
            env={**base, "PYTHONPATH": f"{base['PYTHONPATH']}:{user}"},
            cwd=str(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        who, path = done.stdout.rsplit(" / ", 1)
        assert who == "user config / user protocol"
        assert str(REPO / "shim") not in path


def test_image_sitecustomize_still_runs(shim_env: ShimEnv, tmp_path: Path) -> None:
    image = tmp_path / "image"
    image.mkdir()
    (image / "sitecustomize.py").write_text(
        "import os, sys\nsys.stderr.write('image sitecustomize ran as %s\\n' % __name__)\n"
    )
    for base in (shim_env.env, shim_env.without_shim()):
        env = {**base, "PYTHONPATH": base["PYTHONPATH"] + ":" + str(image)}
        result, stderr = probe(env, shim_env.pids)
        assert "image sitecustomize ran as sitecustomize" in stderr
        assert result["active"] is ("JITCKPT_DIR" in env)


def test_broken_image_sitecustomize_reported_like_site_does(
    shim_env: ShimEnv, tmp_path: Path
) -> None:
    image = tmp_path / "image"
    image.mkdir()
    (image / "sitecustomize.py").write_text("raise RuntimeError('image is broken')\n")
    env = {**shim_env.env, "PYTHONPATH": shim_env.env["PYTHONPATH"] + ":" + str(image)}
    result, stderr = probe(env, shim_env.pids)
    assert result["active"] is True
    assert "Error in sitecustomize; set PYTHONVERBOSE for traceback:" in stderr
    assert "RuntimeError: image is broken" in stderr


def test_unusable_run_dir_said_once_and_program_runs(shim_env: ShimEnv) -> None:
    blocker = shim_env.root / "not-a-dir"
    blocker.write_text("")
    env = {**shim_env.env, "JITCKPT_SOCKET": str(blocker / "agent.sock")}
    result, stderr = probe(env, shim_env.pids)
    assert result["active"] is True
    lines = jit_lines(stderr)
    assert len(lines) == 1 and "pid registration" in lines[0], stderr


def injected_prestop(run_dir: Path) -> list[str]:
    """The trainer's preStop command exactly as the webhook injects it, pointed at ``run_dir``."""
    fixture = REPO / "tests/webhook/testdata/fixtures/pytorchjob-master.yaml"
    namespace = NamespaceInfo(
        "team-a",
        {"jitckpt.io/injection": "enabled"},
        {"jitckpt.io/destination": "s3://bucket/prefix"},
    )
    result = mutate(yaml.safe_load(fixture.read_text()), namespace, WebhookConfig())
    assert result.injected, result.message
    [trainer] = [c for c in result.pod["spec"]["containers"] if c["name"] == "pytorch"]
    command: list[str] = trainer["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "/bin/sh"
    return [part.replace(layout.RUN_DIR, str(run_dir)) for part in command]


def test_prestop_reaches_python_under_a_shell(shim_env: ShimEnv, spawn: Spawn) -> None:
    """A shell parent forwards no SIGTERM; the hook signals the pid file's process itself."""
    script = "import time; print('ready', flush=True); time.sleep(60)"
    shell = spawn(
        ["bash", "-c", f'{PYTHON} -c "{script}"; echo python-exit=$?'],
        shim_env.env,
    )
    shell.wait_for("ready")
    registered = [path.name for path in shim_env.pids.iterdir()]
    assert len(registered) == 1
    command = injected_prestop(shim_env.run)
    started = time.monotonic()
    subprocess.run(command, check=True, timeout=10)
    assert shell.wait(timeout=10) == 0
    assert time.monotonic() - started < 5
    assert f"python-exit={128 + signal.SIGTERM}" in shell.output()
    # Killed by the default action, it could not remove its file: the next process prunes it.
    result, _ = probe(shim_env.env, shim_env.pids)
    assert result["pids"] == [f"{result['pid']}.pid"]


# A worker that takes a second to stop, as one saving a JIT checkpoint does.
SLOW_TO_STOP = """
import os, signal, time
def stop(signum, frame):
    time.sleep(1.0)
    os._exit(143)
signal.signal(signal.SIGTERM, stop)
print("worker up", flush=True)
time.sleep(120)
"""


def test_torchrun_stops_its_worker_once_under_prestop_then_kubelet_sigterm(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """The pod's stop as a kubelet does it: the preStop hook signals every registered process
    (torchrun and its worker), then SIGTERM reaches PID 1, torchrun, while it is stopping its
    worker. torchrun stops it once, without a logging traceback, and exits 143."""
    script = tmp_path / "worker.py"
    script.write_text(SLOW_TO_STOP)
    run = spawn([TORCHRUN, "--nproc-per-node=1", str(script)], shim_env.env)
    run.wait_for("worker up", timeout=120)
    assert len(list(shim_env.pids.iterdir())) == 2  # torchrun and its worker
    subprocess.run(injected_prestop(shim_env.run), check=True, timeout=10)
    time.sleep(0.3)  # the kubelet's SIGTERM comes once the hook is done
    run.signal(signal.SIGTERM)
    assert run.wait(timeout=60) == 143, run.output()
    output = run.output()
    assert output.count("closing signal SIGTERM") == 1, output
    assert "Logging error" not in output and "Unable to shutdown" not in output, output


def test_prestop_with_no_registered_process_succeeds(shim_env: ShimEnv) -> None:
    command = injected_prestop(shim_env.run)
    assert subprocess.run(command, check=False, timeout=10).returncode == 0


def _interpreter(version: str) -> str | None:
    """``pythonX.Y`` on PATH, or installed by pyenv (whose shims need a selected version),
    or beside the interpreter this venv was made from (pyenv's versions, pyenv off PATH)."""
    candidates = [shutil.which(f"python{version}")]
    roots = [Path(sys.base_prefix).parent]
    if shutil.which("pyenv"):
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, check=False)
        roots.insert(0, Path(root.stdout.strip()) / "versions")
    for versions in roots:
        candidates += [str(p) for p in sorted(versions.glob(f"{version}.*/bin/python{version}"))]
    for found in candidates:
        if found is None:
            continue
        done = subprocess.run([found, "-c", "pass"], capture_output=True, check=False, timeout=30)
        if done.returncode == 0:
            return found
    return None


@pytest.mark.parametrize("version", ["3.9", "3.10", "3.12", "3.13"])
def test_shim_on_other_pythons(version: str, shim_env: ShimEnv, tmp_path: Path) -> None:
    """Every shim module compiles, and the shim activates and hooks, on Python 3.9 to 3.13."""
    python = _interpreter(version)
    if python is None:
        unavailable(f"python{version} is not installed here (the shim promises 3.9 to 3.13)")
    sources = sorted(str(path) for path in (REPO / "shim").glob("*.py"))
    compile_all = "import sys\nfor f in sys.argv[1:]: compile(open(f).read(), f, 'exec')"
    subprocess.run([python, "-c", compile_all, *sources], check=True, timeout=60)
    fake = tmp_path / "site" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = 'old'\n")
    (fake / "trainer.py").write_text("class Trainer:\n    pass\n")
    script = "import sys, transformers.trainer; print('_jitckpt_shim' in sys.modules)"
    done = subprocess.run(
        [python, "-c", script],
        env={**shim_env.env, "PYTHONPATH": f"{shim_env.env['PYTHONPATH']}:{fake.parent}"},
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "True"
    assert "transformers old lacks" in done.stderr
    assert len(jit_lines(done.stderr)) == 1, done.stderr

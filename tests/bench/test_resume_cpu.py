"""The resume CPU diagnostic's sampler: CPU seconds per command over a window."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.resume_cpu import CpuSampler, command_of, read_cpu

BUSY = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\n"
IDLE = "import time; time.sleep(1.2)"


def test_a_window_counts_the_cpu_each_command_used_in_it(tmp_path) -> None:
    busy_script = tmp_path / "busy_work.py"
    busy_script.write_text(BUSY)
    idle_script = tmp_path / "idle_work.py"
    idle_script.write_text(IDLE)
    with CpuSampler(period=0.05).running() as sampler:
        time.sleep(0.2)
        start = time.monotonic()
        busy = subprocess.Popen([sys.executable, str(busy_script)])
        idle = subprocess.Popen([sys.executable, str(idle_script)])
        busy.wait(timeout=60)
        idle.wait(timeout=60)
        end = time.monotonic()
        time.sleep(0.2)
    used = sampler.between(start, end)
    program = f"{sys.executable.rsplit('/', 1)[-1]}"
    assert used[f"{program} busy_work.py"] >= 0.5
    assert used.get(f"{program} idle_work.py", 0.0) < 0.3
    assert sampler.between(end + 0.1, end + 0.2).get(f"{program} busy_work.py", 0.0) == 0.0


def test_a_process_reads_as_its_program_and_script() -> None:
    child = subprocess.Popen([sys.executable, "-u", "-c", "import time; time.sleep(5)"])
    try:
        time.sleep(0.2)
        assert command_of(child.pid).startswith(sys.executable.rsplit("/", 1)[-1])
        cpu = read_cpu(child.pid)
        assert cpu is not None and cpu.user >= 0.0
    finally:
        child.kill()
        child.wait()
    assert read_cpu(child.pid) is None

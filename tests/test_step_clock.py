"""The step clock's host CPU figures (trainers/clock.py): a step's CPU seconds are the process's
work, not its wall time, and the trial's host_busy is the ranks' work over the hosts' cores."""

import threading
import time

import pytest
import torch

from trainers.clock import StepClock, host_figures


def _spin(cpu_seconds: float) -> None:
    """Work until this thread has had ``cpu_seconds`` of a core (however busy the machine)."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


def test_a_step_s_cpu_time_counts_work_and_not_waiting():
    clock = StepClock(torch.device("cpu"))
    clock.start()
    _spin(0.2)
    worked = clock.stop()
    clock.start()
    time.sleep(0.2)  # a collective's wait, a peer's turn: the host idles
    waited = clock.stop()
    assert 0.2 <= clock.cpu_s[0] <= worked + 0.01  # the work, never more than the step's wall time
    assert waited >= 0.2 and clock.cpu_s[1] < 0.02


def test_a_step_s_cpu_time_counts_every_thread_of_the_process():
    clock = StepClock(torch.device("cpu"))
    clock.start()
    helper = threading.Thread(target=_spin, args=(0.15,))  # another thread's work counts too
    helper.start()
    _spin(0.15)
    helper.join()
    clock.stop()
    assert clock.cpu_s[0] >= 0.3 - 0.01


def test_host_busy_is_the_ranks_work_over_the_hosts_cores():
    # two ranks on a 2-core host (1 core each), 0.8 s steps: 0.6 and 0.4 CPU-s of work
    assert host_figures([0.6, 0.4], [1.0, 1.0], 0.8) == {"host_cpu_s": 0.6, "host_busy": pytest.approx(0.625)}
    # four ranks on the same host (half a core each) doing half the work each: as busy; on two
    # such hosts (a core each) the same work fills half of them
    assert host_figures([0.3, 0.2, 0.3, 0.2], [0.5] * 4, 0.8)["host_busy"] == pytest.approx(0.625)
    assert host_figures([0.3, 0.2, 0.3, 0.2], [1.0] * 4, 0.8)["host_busy"] == pytest.approx(0.3125)


def test_the_host_s_cores_are_the_fewest_of_machine_affinity_and_cgroup_quota(tmp_path):
    """A container's CPU limit caps the cores a worker may use (cgroup v2 and v1 files as the kernel
    writes them), so the trainer's threads and host_busy are counted against it, not the machine."""
    from trainers.host import host_cores

    machine = host_cores(str(tmp_path / "none"))  # no control files: affinity and cpu_count alone
    assert machine >= 1
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")  # a pod limited to 1.5 cores
    assert host_cores(str(v2)) == min(machine, 1.5)
    (v2 / "cpu.max").write_text("max 100000\n")  # no limit
    assert host_cores(str(v2)) == machine
    (v2 / "cpu.max").write_text("50000 100000\n")  # half a core: still one thread's worth
    assert host_cores(str(v2)) == 1.0
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert host_cores(str(tmp_path / "v1")) == 1.0
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert host_cores(str(tmp_path / "v1")) == machine

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

"""The count of cores other processes keep busy, which sets torch's CPU threads at a load."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmcli.models import busy_cores

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat")


def _spin_for(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_another_process_spinning_is_counted_over_a_window_opened_before() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # the spinner's interpreter started
        busy_cores.open_window()
        time.sleep(0.3)
        assert busy_cores.busy_cores_elsewhere() >= 1
    finally:
        spinner.kill()
        spinner.wait()


def test_this_processs_own_work_in_the_window_is_taken_off() -> None:
    """Our own spinning over the window is not someone else's: the count stays below what every
    process together used less what we used (read right after it, so within a tick or two)."""
    busy_cores.open_window()
    opened, before, own_before = busy_cores._window  # type: ignore[misc]
    _spin_for(0.5)
    elsewhere = busy_cores.busy_cores_elsewhere()
    after, own_after, elapsed = (
        busy_cores._cpu_busy_and_total(),
        busy_cores._own_cpu_s(),
        time.monotonic() - opened,
    )
    cpus = set(os.sched_getaffinity(0)) & set(before) & set(after)
    everyone = sum((after[c][0] - before[c][0]) / max(1, after[c][1] - before[c][1]) for c in cpus)
    ours = (own_after - own_before) / elapsed
    assert elsewhere <= everyone - ours + 0.3 + 0.15


def test_a_window_too_old_is_not_read() -> None:
    busy_cores.open_window()
    opened, before, own = busy_cores._window  # type: ignore[misc]
    # Counts from long ago in which every core was busy the whole time: not read, a fresh short
    # window is, so a machine this idle is not taken for a full one.
    busy_cores._window = (opened - busy_cores.OLDEST_WINDOW_S, {c: (0, 0) for c in before}, own)
    started = time.monotonic()
    busy_cores.busy_cores_elsewhere()
    assert time.monotonic() - started >= busy_cores.SHORTEST_WINDOW_S * 0.9  # it slept a window

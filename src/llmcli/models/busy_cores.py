"""How many cores other processes keep busy right now, from /proc/stat — torch-free, so that the
window it measures over can open before torch is imported.

A load opens the window first (`open_window`) and reads it when it sets torch's threads, a
second or so later: what the load itself used meanwhile (this process's CPU time) is taken off,
so no one has to sleep through a window of idleness to count someone else's work. Without an
open window, or with one too old to speak for now, the count sleeps through a short one.
"""

from __future__ import annotations

import os
import time

SHORTEST_WINDOW_S = 0.1  # below, /proc/stat's 10 ms ticks are too coarse to count a core
OLDEST_WINDOW_S = 5.0  # a window opened longer ago says little about the machine now

_window: tuple[float, dict[int, tuple[int, int]], float] | None = None  # (when, per CPU, our CPU s)


def open_window() -> None:
    """Start counting, unless a window opened recently enough is counting already."""
    global _window
    if _window is not None and time.monotonic() - _window[0] < OLDEST_WINDOW_S:
        return
    try:
        _window = (time.monotonic(), _cpu_busy_and_total(), _own_cpu_s())
    except (OSError, ValueError, IndexError):
        _window = None


def busy_cores_elsewhere() -> int:
    """Cores kept busy by other processes since the window opened (0 where unreadable)."""
    global _window
    window, _window = _window, None
    if window is None or time.monotonic() - window[0] >= OLDEST_WINDOW_S:
        open_window()
        window, _window = _window, None
        if window is None:
            return 0
    opened, before, own_before = window
    time.sleep(max(0.0, SHORTEST_WINDOW_S - (time.monotonic() - opened)))
    try:
        after, own_after = _cpu_busy_and_total(), _own_cpu_s()
    except (OSError, ValueError, IndexError):
        return 0
    elapsed = time.monotonic() - opened
    ours = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(before)
    busy = 0.0
    for cpu in ours & set(before) & set(after):
        busy_delta = after[cpu][0] - before[cpu][0]
        total_delta = after[cpu][1] - before[cpu][1]
        if total_delta > 0:
            busy += busy_delta / total_delta
    busy -= (own_after - own_before) / elapsed  # the cores this process kept busy meanwhile
    # A core counts as taken when someone uses most of it; light background noise does not.
    return max(0, int(busy + 0.3))


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _cpu_busy_and_total() -> dict[int, tuple[int, int]]:
    """Per CPU: (busy jiffies, total jiffies) since boot."""
    counts: dict[int, tuple[int, int]] = {}
    with open("/proc/stat") as stat:
        for line in stat:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            values = [int(v) for v in fields[:8]]
            idle = values[3] + values[4]  # idle + iowait
            counts[int(name[3:])] = (sum(values) - idle, sum(values))
    return counts

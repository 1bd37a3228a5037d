"""Which process a pid names now, checked before anything signals it or sends it a prompt.

A pid read from a file is a number from disk: the process that wrote it may be gone and the
number reused, or the file may never have been written by llmcli. A server therefore records who
it is when it starts — its pid, its start time and its command line — and a reader believes the
record only while a live process matches all three. A zombie (exited, not yet reaped by whoever
started it) is not running: it has already let go of its socket and its record.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

# The largest pid any Linux allows (pid_max's ceiling, 2**22); other systems stay below 2**31.
_PID_CEILING = 2**31 - 1
# Start times are read back from the system with a clock tick's precision.
_START_TOLERANCE_S = 0.05


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    started: float  # seconds since the epoch, as the system reports the process's start
    argv: tuple[str, ...]

    @classmethod
    def of_this_process(cls) -> ProcessIdentity:
        me = psutil.Process()
        return cls(os.getpid(), me.create_time(), tuple(me.cmdline()))


def is_pid(value: object) -> bool:
    """A process id as a record may name one: a positive int (not a bool, a float or a text),
    small enough to be a pid. 0 and negative numbers name process groups to kill(2)."""
    return type(value) is int and 0 < value <= _PID_CEILING


def is_running(identity: ProcessIdentity) -> bool:
    """Whether the process `identity` describes still runs: same pid, same start, same command
    line, and not a zombie."""
    try:
        process = psutil.Process(identity.pid)
        with process.oneshot():
            if process.status() == psutil.STATUS_ZOMBIE:
                return False
            if abs(process.create_time() - identity.started) > _START_TOLERANCE_S:
                return False  # the pid was reused
            return tuple(process.cmdline()) == identity.argv
    except (psutil.Error, OSError, ValueError):
        return False  # gone, or not ours to look at: not a process to signal either


def listens_on(pid: int, port: int) -> bool | None:
    """Whether `pid` holds a listening socket on `port`; None where the system will not say."""
    try:
        connections = psutil.Process(pid).net_connections(kind="inet")
    except psutil.AccessDenied:
        return None
    except (psutil.Error, OSError, ValueError):
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in connections)

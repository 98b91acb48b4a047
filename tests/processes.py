"""Child processes the tests start and read: a line read never waits without a bound, and a
command's signal handlers can be seen from outside (Linux).

A bare ``process.stdout.readline()`` blocks for as long as the child neither writes nor
exits, so one hung child hangs the whole run; :class:`Lines` reads on a thread of its own and
:meth:`Lines.next` gives up after its timeout, naming what the child printed on stderr."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path


class Lines:
    """The lines a child writes to its stdout (a text pipe), read on a daemon thread."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None, "start the process with stdout=subprocess.PIPE"
        self.process = process
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def next(self, timeout: float = 60) -> str:
        """The next line; an AssertionError when the child exits first or none comes within
        ``timeout`` seconds."""
        try:
            line = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line from the child within {timeout} s") from None
        if line is None:
            self._queue.put(None)  # later calls see the end too
            raise AssertionError(f"the child exited ({self.process.poll()}) before a line")
        return line

    def rest(self, timeout: float = 10) -> str:
        """What the child writes from here until it closes its stdout."""
        lines = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"stdout still open after {timeout} s") from None
            if line is None:
                self._queue.put(None)
                return "".join(lines)
            lines.append(line)


def caught_signals(pid: int) -> set[int] | None:
    """The signals a process has handlers for, from ``/proc`` (None where there is no
    ``/proc``, or once the process is gone)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            mask = int(line.split()[1], 16)
            return {number for number in range(1, 65) if mask >> (number - 1) & 1}
    return None


def wait_for(condition: Callable[[], bool], what: str, timeout: float) -> float:
    """Seconds until ``condition()`` holds (an AssertionError naming ``what`` after
    ``timeout``)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.01)
    return time.monotonic() - started

"""How kvblocks' long-running commands (``kvblocks route``, the endpoint picker) stop on
SIGTERM and SIGINT, read their fleet again on SIGHUP, and take their snapshot options (kept
here, light to import, for the commands' parsers).

A handler that raises (``KeyboardInterrupt`` from SIGTERM, as ``kvblocks route`` had) lets
the exception out of whatever statement the main thread is in when the signal lands: between
printing the "serving on" line and entering the ``try`` that caught it, the command died
with a traceback and status -2. So the handlers here only note the signal. They are
installed before the command does anything else (SIGINT's first, then SIGTERM's, so that a
process catching SIGTERM catches both); a signal during start-up is noted, the command
finishes starting, and :meth:`StopSignals.wait` returns at once; the command then closes what
it opened and exits with status 0. Signals during shutdown are ignored (a stuck shutdown
still yields to SIGKILL; each of the command's own joins is bounded).

Blocking the signals instead (``pthread_sigmask`` and ``sigwait``) does not hold: threads
started before the command runs (numpy's OpenBLAS pool, at import) do not block them, and
the kernel delivers a process's SIGTERM to such a thread, where its default action ends the
process.

A signal that arrives before the command runs at all (the interpreter starting, ``kvblocks``
being imported) ends the process as for any Python program.

SIGHUP asks a running command to read its fleet file again (:class:`ReloadSignal`), as daemons
take it; its handler too only notes it.
"""

from __future__ import annotations

import argparse
import signal
import time

#: SIGINT first: see the module's documentation.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Notes SIGINT and SIGTERM from construction on (in the main thread, where Python runs
    signal handlers); ``wait`` returns the first to arrive."""

    def __init__(self, poll_interval: float = 0.1) -> None:
        self._received: int | None = None
        self._poll_interval = poll_interval
        for number in STOP_SIGNALS:
            signal.signal(number, self._note)

    def _note(self, number: int, frame: object) -> None:
        if self._received is None:
            self._received = number

    @property
    def received(self) -> int | None:
        """The first stop signal that arrived, if any."""
        return self._received

    def wait(self, timeout: float | None = None) -> int | None:
        """Blocks until SIGINT or SIGTERM has arrived (at once if one has); its number, or
        None once ``timeout`` seconds passed without one. The handler interrupts the sleep,
        which then runs out its interval. Once a signal is returned both signals are
        ignored: the command is stopping, and Python's finalization resets a signal with a
        Python handler to its default action (a second SIGTERM while the interpreter exits
        would kill the process), but leaves an ignored one ignored."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._received is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(self._poll_interval)
        for number in STOP_SIGNALS:
            signal.signal(number, signal.SIG_IGN)
        return self._received


class ReloadSignal:
    """Notes SIGHUP from construction on (in the main thread): the fleet file is to be read
    again. :meth:`take` says whether one arrived since it was last asked."""

    def __init__(self) -> None:
        self._count = 0
        self._taken = 0
        signal.signal(signal.SIGHUP, self._note)

    def _note(self, number: int, frame: object) -> None:
        self._count += 1

    def take(self) -> bool:
        arrived = self._count != self._taken
        self._taken = self._count
        return arrived


def add_snapshot_arguments(parser: argparse.ArgumentParser) -> None:
    """``--snapshot FILE`` and ``--snapshot-interval``, for the commands that serve an index."""
    parser.add_argument(
        "--snapshot",
        metavar="FILE",
        help="keep the index in FILE: restored at start, saved every --snapshot-interval "
        "seconds and at the end; a restart then resumes each feed through the replica's "
        "replay endpoint instead of starting empty",
    )
    parser.add_argument("--snapshot-interval", type=float, default=60.0, metavar="SECONDS")

"""``kvblocks route`` stops cleanly whenever SIGTERM or SIGINT arrives: during start-up, while
serving and during shutdown, with status 0 and no traceback (``kvblocks._signals``).

Before the fix, SIGTERM raised ``KeyboardInterrupt`` from a handler installed after the fleet
loaded, so a signal between the "serving on" line and the ``try`` that caught it (seen under
load in CI) ended the command with a traceback and status -2, and a SIGINT anywhere in
start-up did the same. Here many runs get their signal at spread-out moments, some a second
one during shutdown."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.processes import Lines, caught_signals

pytest.importorskip("msgspec")
pytest.importorskip("zmq")
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

FLEET = {"replicas": [{"name": "a", "hash_algo": "sha256", "hash_block_size": 16}]}
STOPS = (signal.SIGTERM, signal.SIGINT)


def start(fleet: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvblocks", "route", str(fleet), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise AssertionError("the command did not stop within 30 s of its signal") from None
    return process.returncode, out, err


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(FLEET))
    return path


def test_the_command_serves_until_stopped(fleet: Path) -> None:
    process = start(fleet)
    try:
        line = Lines(process).next(timeout=60)
        assert "serving on http://127.0.0.1:" in line, line
        url = line.split("serving on ", 1)[1].split()[0]
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            assert json.loads(response.read()) == {"status": "ok"}
    finally:
        process.terminate()
    code, _, err = finish(process)
    assert (code, err) == (0, "")


def serving_time(fleet: Path) -> float:
    """Seconds from spawn to the "serving on" line, on this machine now."""
    began = time.monotonic()
    process = start(fleet)
    try:
        Lines(process).next(timeout=60)
        return time.monotonic() - began
    finally:
        process.terminate()
        finish(process)


def signalled(fleet: Path, number: int, delay: float, after_handler: bool, again: bool) -> tuple:
    """One run: the signal ``delay`` seconds after spawn (or after the command installed its
    SIGTERM handler, seen in /proc: Python catches SIGINT from its start), and with
    ``again`` a second one shortly after."""
    process = start(fleet)
    if after_handler:
        deadline = time.monotonic() + 30
        while signal.SIGTERM not in (caught_signals(process.pid) or set()):
            assert process.poll() is None, finish(process)
            assert time.monotonic() < deadline, "the command never caught SIGTERM"
            time.sleep(0.001)
    time.sleep(delay)
    process.send_signal(number)
    if again:
        time.sleep(random.uniform(0, 0.05))
        if process.poll() is None:
            process.send_signal(number)
    return (number, delay, after_handler, *finish(process))


def test_a_stop_signal_at_any_moment_ends_it_cleanly(fleet: Path) -> None:
    """SIGTERM at 36 moments spread from spawn to past the "serving on" line, and SIGTERM
    or SIGINT at 24 moments from the instant the command caught them (start-up: importing
    the service, loading the fleet, binding the port) on, half with a second signal during
    shutdown. A SIGTERM that lands while the interpreter is still starting, before kvblocks'
    code runs, kills the process as any (status -SIGTERM, nothing printed): that alone is
    a clean stop, and only a run that printed nothing may end so; every run signalled once
    the handler is there ends with status 0."""
    span = 2 * serving_time(fleet)  # three at a time below: slower than alone
    rng = random.Random(43)
    runs = [(signal.SIGTERM, span * (i + rng.random()) / 36, False, i % 2 == 1) for i in range(36)]
    # Where /proc shows the handlers (Linux): a signal is sure to find the handler there.
    handled = caught_signals(os.getpid()) is not None
    if handled:
        runs += [
            (STOPS[i % 2], (span / 2) * (i // 2) / 12 * rng.random(), True, i % 4 >= 2)
            for i in range(24)
        ]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda run: signalled(fleet, *run), runs))
    for number, delay, after_handler, code, out, err in results:
        what = f"{signal.Signals(number).name} at {delay:.3f} s (handler seen: {after_handler})"
        assert "Traceback" not in err, f"{what}: {err}"
        if code == -signal.SIGTERM and number == signal.SIGTERM and not after_handler:
            assert (out, err) == ("", ""), f"{what}: killed after it printed {out!r} {err!r}"
            continue
        assert (code, err) == (0, ""), f"{what}: status {code}, {err!r}"
    if handled:
        # A signal right after the handler lands in start-up (the service's imports follow).
        before_serving = [r for r in results if r[2] and "serving on" not in r[4]]
        assert before_serving, "no signal landed during start-up"

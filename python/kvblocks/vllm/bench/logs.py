"""Keeps the terminal of ``kvblocks bench --engine vllm`` readable: what vLLM's loggers say
while a phase of the benchmark runs (its start-up, its progress bar) is held back and shown
afterwards, each distinct message once with the number of times it was logged.

vLLM rebuilds its configuration for every run, and its platform checks warn again each time
("CPU backend prefers block_size ..."); printed as they come, they split the progress bar
line by line. Nothing is dropped: the messages are only routed and counted. kvblocks' own
logger (``vllm.kvblocks``, under vLLM's) is lowered to INFO for the phase, so its one-line
notes on what runs on kvblocks appear in the summary even where vLLM's logging is not
configured (in a plain Python process vLLM sets up no handler, and Python shows only
warnings). Importing this module does not import vLLM.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

#: The root of vLLM's logger tree; kvblocks logs under it as ``vllm.kvblocks``.
VLLM_LOGGER = "vllm"
KVBLOCKS_LOGGER = "vllm.kvblocks"


class _Collector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def held_back() -> Iterator[list[logging.LogRecord]]:
    """Inside the block, the records of vLLM's logger tree go into the yielded list instead
    of vLLM's handlers (or Python's last-resort handler); afterwards the loggers are as they
    were."""
    tree = logging.getLogger(VLLM_LOGGER)
    ours = logging.getLogger(KVBLOCKS_LOGGER)
    saved_handlers, saved_propagate, saved_level = tree.handlers[:], tree.propagate, ours.level
    collector = _Collector()
    tree.handlers = [collector]
    tree.propagate = False
    if ours.getEffectiveLevel() > logging.INFO:
        ours.setLevel(logging.INFO)
    try:
        yield collector.records
    finally:
        tree.handlers = saved_handlers
        tree.propagate = saved_propagate
        ours.setLevel(saved_level)


def summary(records: list[logging.LogRecord]) -> list[str]:
    """One line per distinct message, in the order first logged, with its count."""
    counts = Counter((r.levelname, r.name, r.getMessage()) for r in records)
    return [
        f"{level} [{name}] {message}" + (f" ({n} times)" if n > 1 else "")
        for (level, name, message), n in counts.items()
    ]

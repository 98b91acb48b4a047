"""The README and docs/*.md as a new user reads them: every ```python block runs as written,
and every install line names something that installs.

Each block runs alone in a fresh process (a reader copies one block at a time), so a block
must define what it uses. Markers, in an HTML comment on the line(s) right above a block:

- ``<!-- readme-test: requires torch -->`` (or ``vllm``, or both, comma-separated): the block
  needs that optional package; it is skipped where the package cannot be imported (except
  that ``KVBLOCKS_REQUIRE_VLLM=1``, set by ``.ci/run``, makes a missing vllm a failure).
- ``<!-- readme-test: output -->`` above a ```text block: each of its lines must appear in
  what the python block before it printed (stdout or stderr, as part of a line).

Bash blocks are not run.
"""

from __future__ import annotations

import code
import importlib.util
import itertools
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.fresh_process import run_python

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->")
OPTIONAL = ("torch", "vllm")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    markers: list[str] = field(default_factory=list)
    #: For a python block: the ```text block marked as its output, if any.
    output: str | None = None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def requires(self) -> list[str]:
        needs = [
            m.removeprefix("requires").strip() for m in self.markers if m.startswith("requires")
        ]
        return [name.strip() for need in needs for name in need.split(",") if name.strip()]


def fenced_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, each with the markers just above it."""
    blocks: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    markers: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("```"):
            start, lang, body = i, line[3:].strip(), []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", markers))
            markers = []
        elif (match := MARKER.search(line)) is not None:
            markers = [*markers, match[1]]
        elif line:
            markers = []
        i += 1
    for previous, block in itertools.pairwise(blocks):
        if "output" in block.markers:
            assert previous.lang == "python", f"{block.name}: output of a non-python block"
            previous.output = block.code
    return blocks


PYTHON_BLOCKS = [b for path in DOCS for b in fenced_blocks(path) if b.lang == "python"]


def skip_unless_installed(names: list[str]) -> None:
    for name in names:
        assert name in OPTIONAL, f"unknown requirement {name!r} (known: {OPTIONAL})"
        if name == "vllm" and os.environ.get("KVBLOCKS_REQUIRE_VLLM") == "1":
            assert importlib.util.find_spec("vllm") is not None, "KVBLOCKS_REQUIRE_VLLM=1"
        else:
            pytest.importorskip(name, reason=f"this block needs {name}")


def test_the_docs_have_python_blocks() -> None:
    # Guards the parser: the examples must be found, the README's (its status check, with the
    # output it prints) and those of docs/ (the Python API, the engine).
    readme = [b for b in PYTHON_BLOCKS if b.path.name == "README.md"]
    assert readme
    assert any(b.output is not None for b in readme)
    assert len(PYTHON_BLOCKS) - len(readme) >= 6


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.name)
def test_python_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    skip_unless_installed(block.requires())
    run = run_python(block.code, cwd=tmp_path)
    printed = run.stdout + run.stderr
    assert run.returncode == 0, f"{block.name} failed:\n{printed[-4000:]}"
    if block.output is not None:
        lines = printed.splitlines()
        for expected in filter(None, (x.strip() for x in block.output.splitlines())):
            assert any(expected in line for line in lines), (
                f"{block.name}: {expected!r} not printed; got:\n{printed[-4000:]}"
            )


class _PastedConsole(code.InteractiveConsole):
    """Python's interactive interpreter, fed a block line by line as a paste feeds it, that
    compiles each statement it completes and runs none; it keeps the syntax errors."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[str] = []

    def runcode(self, code: Any) -> None:
        pass

    def showsyntaxerror(self, filename: str | None = None, **kwargs: Any) -> None:
        error = sys.exc_info()[1]
        self.errors.append(f"{type(error).__name__}: {error}")


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.name)
def test_python_block_pastes_into_the_interactive_interpreter(block: Block) -> None:
    """Pasted into ``python`` a blank line ends an indented block, and a statement cannot
    follow a one-line compound statement without one: each block must still compile line by
    line as the interpreter reads it."""
    console = _PastedConsole()
    for line in block.code.splitlines():
        console.push(line)
    console.push("")
    assert console.errors == [], f"{block.name}: {console.errors}"


INSTALL = re.compile(r"pip install ([^`\n#]*)")
EXTRAS = re.compile(r"""["']?([\w.-]+)\[([\w,\s-]+)\]["']?""")


def test_install_lines_name_extras_that_exist_and_no_unpublished_package() -> None:
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    seen = 0
    for path in DOCS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for command in INSTALL.findall(line):
                seen += 1
                for target, names in EXTRAS.findall(command):
                    where = f"{path.relative_to(ROOT)}:{number}: pip install {command.strip()}"
                    # kvblocks is not on PyPI: install from the checkout (".[extra]").
                    assert target == "." or "once published" in line, where
                    for name in names.split(","):
                        assert name.strip() in extras, f"{where}: no extra {name.strip()!r}"
    assert seen >= 3

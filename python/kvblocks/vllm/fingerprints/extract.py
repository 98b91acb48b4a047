"""Fingerprints of Python source: a whole file, named top-level objects, or the statements
that name given words. Reads and parses the text only; imports nothing from it.

An object's text is its source lines, decorators included, exactly as ``inspect.getsource``
returns them, with line ends normalized to ``\\n``; a fingerprint is the sha256 of that text
(UTF-8) in hex. Source text, not the syntax tree, is hashed because ``ast.dump`` differs
between Python versions while the text does not.
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Callable, Iterable, Iterator

_Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
_Node = ast.expr | ast.stmt
_COMPOUND_HEADERS = {
    ast.If: ("test",),
    ast.While: ("test",),
    ast.For: ("target", "iter"),
    ast.AsyncFor: ("target", "iter"),
    ast.With: ("items",),  # withitem has no position: its context_expr is used
    ast.AsyncWith: ("items",),
    ast.Try: (),
    ast.TryStar: (),
    ast.Match: ("subject",),
}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def normalize(data: bytes) -> bytes:
    """Universal newlines, as ``inspect`` and ``linecache`` read source."""
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


class Module:
    """One parsed source file."""

    def __init__(self, data: bytes) -> None:
        self._data = normalize(data)
        self._lines = self._data.splitlines(keepends=True)
        self._tree = ast.parse(self._data)

    def _lines_of(self, node: ast.stmt) -> bytes:
        first = node.lineno
        if isinstance(node, _Def) and node.decorator_list:
            first = min(first, *(d.lineno for d in node.decorator_list))
        end = node.end_lineno or node.lineno
        return b"".join(self._lines[first - 1 : end])

    def _segment(self, node: _Node) -> bytes:
        """The exact text of an expression or statement (``col_offset`` counts UTF-8 bytes)."""
        first, end = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        start_col, end_col = node.col_offset, node.end_col_offset
        if first == end:
            return self._lines[first][start_col:end_col]
        return (
            self._lines[first][start_col:]
            + b"".join(self._lines[first + 1 : end])
            + self._lines[end][:end_col]
        )

    def objects(self, names: Iterable[str]) -> dict[str, str]:
        """Fingerprint of each named object found: ``"name"`` for a top-level function,
        class or assigned name, ``"Class.name"`` for one in a top-level class body. A name
        bound by several statements (an overload, a property setter) covers all of them."""
        found = {}
        for name in names:
            *owner, leaf = name.split(".")
            if len(owner) > 1:
                raise ValueError(f"{name!r}: at most one class level")
            body: list[ast.stmt] | None = self._tree.body
            if owner:
                body = next(
                    (
                        s.body
                        for s in self._tree.body
                        if _binds(s, owner[0]) and isinstance(s, ast.ClassDef)
                    ),
                    None,
                )
            nodes = [s for s in body or () if _binds(s, leaf)]
            if nodes:
                found[name] = sha256(b"".join(self._lines_of(s) for s in nodes))
        return found

    def mentions(self, words: Iterable[str]) -> dict[str, str]:
        """For each top-level function and each method of a top-level class whose text
        names one of ``words``: the fingerprint of the statements there that name one
        (simple statements whole; for ``if``/``for``/``while``/``with``, the header only, the
        body statement by statement), with the headers of the compound statements around
        them. So an edit elsewhere in a long method changes nothing."""
        pattern = re.compile(rb"\b(?:" + b"|".join(re.escape(w.encode()) for w in words) + rb")\b")
        parts: dict[str, list[bytes]] = {}
        for name, node in self._functions():
            for naming in _naming_nodes(node.body, pattern, self._segment):
                parts.setdefault(name, []).append(self._segment(naming))
        return {name: sha256(b"\n".join(texts)) for name, texts in parts.items()}

    def _functions(self) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for stmt in self._tree.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                yield stmt.name, stmt
            elif isinstance(stmt, ast.ClassDef):
                for inner in stmt.body:
                    if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                        yield f"{stmt.name}.{inner.name}", inner


def _binds(stmt: ast.stmt, name: str) -> bool:
    if isinstance(stmt, _Def):
        return stmt.name == name
    if isinstance(stmt, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
    if isinstance(stmt, ast.AnnAssign):
        return isinstance(stmt.target, ast.Name) and stmt.target.id == name
    return False


def _naming_nodes(
    body: list[ast.stmt], pattern: re.Pattern[bytes], text: Callable[[_Node], bytes]
) -> Iterator[_Node]:
    """The statements (or compound-statement headers) of ``body`` whose text matches, and the
    header of every compound statement that holds one (the ``if`` around a call decides
    whether the call is made, so it is as much the caller's contract as the call)."""
    for stmt in body:
        headers = _COMPOUND_HEADERS.get(type(stmt))
        if headers is None and not isinstance(stmt, _Def):
            if pattern.search(text(stmt)):
                yield stmt
            continue
        inner: list[_Node] = []
        if isinstance(stmt, ast.Try | ast.TryStar):
            for handler in stmt.handlers:
                inner.extend(_naming_nodes(handler.body, pattern, text))
        if isinstance(stmt, ast.Match):
            for case in stmt.cases:
                inner.extend(_naming_nodes(case.body, pattern, text))
        for field in ("body", "orelse", "finalbody"):
            inner.extend(_naming_nodes(getattr(stmt, field, []), pattern, text))
        for field in headers or ():
            value = getattr(stmt, field)
            for part in value if isinstance(value, list) else [value]:
                node = part.context_expr if isinstance(part, ast.withitem) else part
                if inner or pattern.search(text(node)):
                    yield node
        yield from inner

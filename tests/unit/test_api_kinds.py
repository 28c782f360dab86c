"""Coroutines are marked as such in the docs, and the docs and examples await them.

``docs/api.md`` marks each call by what it is in the code: ``await X.f(...)`` for a
coroutine function, ``async for … in X.f(...)`` for an async generator function, no
prefix for a plain call. Runnable docs blocks, fragments and examples are scanned for a
coroutine method called as a statement of its own without ``await`` (the call that does
nothing: only a "never awaited" warning, easy to miss).
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest

import rlinf

ROOT = pathlib.Path(__file__).resolve().parents[2]
_HEADING = re.compile(r"^#{2,3} `(await |async for … in )?([\w.]+)")
_PREFIX = {"await": "await ", "async for": "async for … in ", "": ""}


def _kind(obj) -> str:
    if inspect.iscoroutinefunction(obj):
        return "await"
    if inspect.isasyncgenfunction(obj):
        return "async for"
    return ""


def _resolve(dotted: str):
    obj = rlinf
    for part in dotted.removeprefix("rlinf.").split("."):
        obj = getattr(obj, part)
    return obj


def _documented() -> dict[str, str]:
    """``{"Communicator.send": "await ", ...}`` from the headings of docs/api.md."""
    found = {}
    for line in (ROOT / "docs" / "api.md").read_text().splitlines():
        m = _HEADING.match(line)
        if m:
            found[m.group(2)] = m.group(1) or ""
    return found


def _public_classes() -> list[type]:
    return [obj for name in rlinf.__all__ if inspect.isclass(obj := getattr(rlinf, name))
            and not issubclass(obj, BaseException)]


def _async_members() -> dict[str, dict[str, str]]:
    """``{method name: {class name: kind}}`` over the public methods of the public classes."""
    out: dict[str, dict[str, str]] = {}
    for cls in _public_classes():
        for name in dir(cls):
            if name.startswith("_"):
                continue
            member = inspect.getattr_static(cls, name)
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if callable(member) and not inspect.isclass(member):
                out.setdefault(name, {})[cls.__name__] = _kind(member)
    return out


def test_every_documented_call_has_the_kind_it_has_in_the_code():
    documented = _documented()
    assert len(documented) > 100, "docs/api.md headings not found"
    wrong = [f"{name}: documented {prefix!r}, is {_PREFIX[_kind(_resolve(name))]!r}"
             for name, prefix in documented.items() if prefix != _PREFIX[_kind(_resolve(name))]]
    assert not wrong, wrong


def test_every_public_coroutine_is_documented_as_one():
    documented = _documented()
    missing = [f"{cls}.{name}" for name, kinds in _async_members().items() for cls, kind in kinds.items()
               if kind and documented.get(f"{cls}.{name}") != _PREFIX[kind]]
    assert not missing, f"coroutines missing from docs/api.md or not marked: {missing}"
    # the calls of issue 28 in particular
    assert documented["Communicator.peers"] == documented["Communicator.send"] == "await "
    assert documented["Manager.close"] == documented["Cluster.aclose"] == "await "
    assert documented["Communicator.events"] == "async for … in "
    assert documented["WorkerGroup.kill"] == ""      # a plain call: acts without await (see its docstring)


# ----------------------------------------------------------------------------- docs and examples
def _plain_elsewhere() -> set[str]:
    """Method names of common plain objects (``d.get``, ``",".join``, ``thread.start``,
    ``queue.put``): a call to one of them is not necessarily an rlinf coroutine."""
    import multiprocessing
    import queue
    import subprocess
    import threading

    names = set()
    for cls in (dict, list, str, bytes, set, threading.Thread, queue.Queue, multiprocessing.Process,
                subprocess.Popen):
        names.update(n for n in dir(cls) if not n.startswith("_"))
    return names


def _coroutine_names() -> tuple[set[str], set[str]]:
    """Method names that are coroutines on every public class defining them (and not
    methods of common plain objects), and those that are coroutines on some class but
    plain elsewhere (``send``: Communicator and SyncCommunicator; ``stats``: Channel and
    Communicator; ``get``: Channel and dict)."""
    only, mixed = set(), set()
    plain = _plain_elsewhere()
    for name, kinds in _async_members().items():
        values = set(kinds.values())
        if values == {"await"} and name not in plain:
            only.add(name)
        elif "await" in values:
            mixed.add(name)
    return only, mixed


def _blocks(text: str) -> list[tuple[int, str, bool]]:
    """``(line, code, labelled python)`` of the fenced blocks of a markdown text labelled python or not
    labelled at all (which of those are Python is left to the parser)."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(m.group(1))), len(lines))
        if m.group(2) in ("", "python", "py"):
            out.append((i + 2, "\n".join(lines[i + 1:end]) + "\n", m.group(2) != ""))
        i = end + 1
    return out


def _python_sources() -> list[tuple[str, str, bool]]:
    """``(where, code, surely python)`` for every code block of README.md and docs/*.md
    (a block without a language may be Python) and every example."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        out += [(f"{path.relative_to(ROOT)}:{line}", code, labelled)
                for line, code, labelled in _blocks(path.read_text())]
    for path in sorted((ROOT / "examples").glob("*.py")):
        out.append((str(path.relative_to(ROOT)), path.read_text(), True))
    return out


class _Unawaited(ast.NodeVisitor):
    """Statements that call a coroutine method and drop the coroutine: ``x.peers()`` as
    a statement, or assigned (``r = x.spawn(...)``). A name that is also a plain method
    somewhere (``send`` of the synchronous facade, ``dict.get``) counts only as a
    statement of its own inside an ``async def``."""

    def __init__(self, only: set[str], mixed: set[str]) -> None:
        self.only, self.mixed, self.found, self._async = only, mixed, [], [False]

    def visit_AsyncFunctionDef(self, node):
        self._async.append(True)
        self.generic_visit(node)
        self._async.pop()

    def visit_FunctionDef(self, node):
        self._async.append(False)
        self.generic_visit(node)
        self._async.pop()

    def visit_Lambda(self, node):
        pass

    def _check(self, value, node, *, bare: bool):
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
            name = value.func.attr
            if name in self.only or (name in self.mixed and bare and self._async[-1]):
                self.found.append((node.lineno, ast.unparse(value)))

    def visit_Expr(self, node):
        self._check(node.value, node, bare=True)
        self.generic_visit(node)

    def visit_Assign(self, node):
        self._check(node.value, node, bare=False)
        self.generic_visit(node)


def unawaited_calls(code: str, only: set[str], mixed: set[str]) -> list[tuple[int, str]] | None:
    """The coroutine calls ``code`` drops, or None when it is not Python (a fragment)."""
    try:
        tree = ast.parse(code, feature_version=(3, 11))
    except SyntaxError:
        return None
    visitor = _Unawaited(only, mixed)
    visitor.visit(tree)
    return visitor.found


def test_the_scanner_finds_a_forgotten_await():
    only, mixed = _coroutine_names()
    assert {"peers", "spawn", "aclose", "get_batch", "recv_any"} <= only
    assert {"send", "close", "stats", "join", "get", "put"} <= mixed
    code = ("async def main(comm, cluster, ch):\n"
            "    comm.peers()\n    await comm.send(1, 'a:0')\n    g = cluster.spawn(f, 'w')\n    comm.send(2, 'a:0')\n"
            "    print(comm.stats())\n    task = asyncio.create_task(ch.get())\n    s = ','.join(x)\n"
            "    ch.get()\n"
            "def facade(comm):\n    comm.send(t, dst=1)\n")
    assert unawaited_calls(code, only, mixed) == [(2, "comm.peers()"), (4, "cluster.spawn(f, 'w')"),
                                                  (5, "comm.send(2, 'a:0')"), (9, "ch.get()")]


SOURCES = _python_sources()


def test_docs_and_examples_await_every_coroutine():
    only, mixed = _coroutine_names()
    unparsed, wrong = [], []
    for where, code, python in SOURCES:
        found = unawaited_calls(code, only, mixed)
        if found is None and python:
            unparsed.append(where)      # a ```python block that is not Python would go unchecked
        wrong += [f"{where} (+{line - 1}): {call}" for line, call in found or ()]
    assert not unparsed, f"python blocks that do not parse: {unparsed}"
    assert not wrong, f"coroutines called without await: {wrong}"
    assert sum(python for *_, python in SOURCES) >= 20

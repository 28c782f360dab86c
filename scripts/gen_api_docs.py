"""Write docs/api.md from the docstrings of rlinf's public names (``rlinf.__all__``).

    .venv/bin/python scripts/gen_api_docs.py          # rewrite docs/api.md
    .venv/bin/python scripts/gen_api_docs.py --check  # exit 1 if docs/api.md is stale

The test suite runs ``--check``, so the reference never drifts from the code.
"""

from __future__ import annotations

import asyncio
import inspect
import pathlib
import sys

import rlinf

OUT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md"


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


#: The prefix of a heading, by what calling the function gives (see ``call_kind``).
PREFIX = {"await": "await ", "async for": "async for … in ", "": ""}

LEGEND = """\
How to read a heading: `await Communicator.send(...)` is a coroutine function (`async def`):
calling it without `await` does nothing but make a coroutine object (Python warns "coroutine
... was never awaited"). `async for … in Communicator.events()` is an async iterator. A
heading with neither is a plain call; where it returns something to `await` (a `Work`, a
task) or to use with `async with`, a line under the heading says so, and what it does
before it is awaited.
"""


def call_kind(fn) -> str:
    """``"await"`` for a coroutine function, ``"async for"`` for an async generator
    function, ``""`` for anything else (a plain call, a property, a class)."""
    if inspect.iscoroutinefunction(fn):
        return "await"
    if inspect.isasyncgenfunction(fn):
        return "async for"
    return ""


def _returned_class(fn):
    """The class a plain function's return annotation names, when it is one of rlinf's
    public classes or an asyncio task (by name: annotations are strings here), or the
    name of an async iterator type."""
    try:
        annotation = inspect.signature(fn).return_annotation
    except (TypeError, ValueError):
        return None
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    name = name.split("[")[0].strip()
    if name in ("asyncio.Task", "asyncio.Future"):
        return asyncio.Task
    if name in ("AsyncIterator", "AsyncIterable"):
        return name
    return getattr(rlinf, name, None) if name in rlinf.__all__ else None


def usage_note(obj) -> str:
    """A line on how a plain call or class is used when it involves ``await``/``async``:
    returns an awaitable, an async context manager, or is iterated with ``async for``."""
    if inspect.isclass(obj):
        target = obj
        if hasattr(target, "__aenter__"):
            return "*Async context manager: `async with ...:` (closes on exit).*"
        if hasattr(target, "__aiter__"):
            return "*Async iterable: `async for item in ...:`.*"
        if hasattr(target, "__await__"):
            return "*Awaitable: `await` it for the result.*"
        return ""
    if call_kind(obj) or not callable(obj):
        return ""
    returned = _returned_class(obj)
    if returned is None:
        return ""
    if returned in ("AsyncIterator", "AsyncIterable"):
        return "*Plain call returning an async iterator: `async for … in ...`.*"
    if hasattr(returned, "__aenter__"):
        return (f"*Plain call returning a `{returned.__name__}`, an async context manager: "
                "`async with ... as x:`.*")
    if hasattr(returned, "__await__"):
        return (f"*Plain call: acts when called, awaited or not; returns an awaitable "
                f"(`{'asyncio.Task' if returned is asyncio.Task else returned.__name__}`): "
                "`await` it to wait for the outcome.*")
    return ""


def _heading(level: str, name: str, obj, sig: str, suffix: str = "") -> list[str]:
    lines = [f"{level} `{PREFIX[call_kind(obj)]}{name}{sig}`{suffix}", ""]
    note = usage_note(obj)
    return lines + ([note, ""] if note else [])


def _doc(obj) -> str:
    return inspect.cleandoc(obj.__doc__ or "(no docstring)")


def _members(cls) -> list[tuple[str, object]]:
    """The public members of ``cls``, with those it inherits from rlinf's own classes
    (base classes first, in definition order; an override keeps the base's place)."""
    merged: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.split(".")[0] == "rlinf":
            merged.update(vars(klass))
    out = []
    for name, member in merged.items():
        if name.startswith("_") and name not in ("__aenter__", "__await__"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property):
            out.append((name, member))
        elif callable(member) and member.__doc__:
            out.append((name, member))
    return out


def render() -> str:
    lines = ["# API reference", "",
             "Generated from the docstrings by `scripts/gen_api_docs.py`; do not edit by hand.", "",
             LEGEND]
    for name in sorted(rlinf.__all__, key=str.lower):
        obj = getattr(rlinf, name)
        if inspect.ismodule(obj):
            lines += [f"## `rlinf.{name}` (module)", "", _doc(obj), ""]
            for sub in getattr(obj, "__all__", []):
                member = getattr(obj, sub)
                sig = _signature(member) if callable(member) else ""
                lines += _heading("###", f"rlinf.{name}.{sub}", member, sig) + [_doc(member), ""]
            continue
        kind = "class" if inspect.isclass(obj) else "function"
        lines += _heading("##", f"rlinf.{name}", obj, _signature(obj), f" ({kind})") + [_doc(obj), ""]
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for member_name, member in _members(obj):
                sig = "" if isinstance(member, property) else _signature(member)
                lines += _heading("###", f"{name}.{member_name}", member, sig) + [_doc(member), ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if not OUT.exists() or OUT.read_text() != text:
            print("docs/api.md is stale: run scripts/gen_api_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write docs/api.md from the docstrings of rlinf's public names (``rlinf.__all__``).

    .venv/bin/python scripts/gen_api_docs.py          # rewrite docs/api.md
    .venv/bin/python scripts/gen_api_docs.py --check  # exit 1 if docs/api.md is stale

The test suite runs ``--check``, so the reference never drifts from the code.
"""

from __future__ import annotations

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
             "Generated from the docstrings by `scripts/gen_api_docs.py`; do not edit by hand.", ""]
    for name in sorted(rlinf.__all__, key=str.lower):
        obj = getattr(rlinf, name)
        if inspect.ismodule(obj):
            lines += [f"## `rlinf.{name}` (module)", "", _doc(obj), ""]
            for sub in getattr(obj, "__all__", []):
                member = getattr(obj, sub)
                lines += [f"### `rlinf.{name}.{sub}{_signature(member) if callable(member) else ''}`", "",
                          _doc(member), ""]
            continue
        kind = "class" if inspect.isclass(obj) else "function"
        lines += [f"## `rlinf.{name}{_signature(obj)}` ({kind})", "", _doc(obj), ""]
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for member_name, member in _members(obj):
                sig = "" if isinstance(member, property) else _signature(member)
                lines += [f"### `{name}.{member_name}{sig}`", "", _doc(member), ""]
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

"""The shape of the package (DESIGN.md §3, docs/architecture.md), checked on the source.

Each rule is a promise to the next engineer: a lower layer never imports a higher one
(not even lazily inside a function), there are no import cycles, underscore modules and
names stay inside their package, and no module grows past ~700 lines. (That only the
settings module and the launcher boundary read the environment is checked in
``test_config.py``.)
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass, field

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "rlinf"

#: Lowest first. A module may import modules of its own layer or lower ones only.
LAYERS = [
    ("rlinf.errors", "rlinf.config", "rlinf.info", "rlinf.version"),
    ("rlinf.util",),
    ("rlinf.codec",),
    ("rlinf.transports",),
    ("rlinf.control",),
    ("rlinf.core",),
    ("rlinf.collectives",),
    ("rlinf.channel",),
    ("rlinf.weights",),
    ("rlinf.communicator",),
    ("rlinf.launch",),
    ("rlinf.sync",),
    ("rlinf.tools",),
    ("rlinf.demo",),
    ("rlinf.tools.cli",),    # the program: runs the demo, the manager, top and bench
]
#: The curated surface and the public aliases users import (rlinf.routing is named by
#: DESIGN.md; ``import rlinf.ray``; ``python -m rlinf.manager``; paths the docs named
#: before the layout by concern): above every layer.
SURFACE = {"rlinf", "rlinf.__main__", "rlinf.routing", "rlinf.ray", "rlinf.manager", "rlinf.group", "rlinf.reshard",
           "rlinf.leftovers", "rlinf.policies"}
MAX_LINES = 700


@dataclass
class Module:
    name: str
    path: pathlib.Path
    package: str
    imports: list[tuple[str, str | None, int]] = field(default_factory=list)   # (module, name, line)
    typing_only: set[int] = field(default_factory=set)   # lines of imports under ``if TYPE_CHECKING:``


def _name_of(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    rel = pathlib.Path(*name.split("."))
    return (ROOT.parent / rel).with_suffix(".py").exists() or (ROOT.parent / rel / "__init__.py").exists()


def _modules() -> dict[str, Module]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = _name_of(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        module = Module(name, path, package)
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
                module.typing_only.update(n.lineno for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("rlinf"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if _is_module(sub):
                        module.imports.append((sub, None, node.lineno))
                    else:
                        module.imports.append((target, alias.name, node.lineno))
            elif isinstance(node, ast.Import):
                module.imports.extend((a.name, None, node.lineno) for a in node.names if a.name.startswith("rlinf"))
        found[name] = module
    return found


MODULES = _modules()


def _layer(name: str) -> int | None:
    """The layer of the longest prefix of ``name`` in :data:`LAYERS`."""
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best_len:
                best, best_len = index, len(p)
    return best


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if m not in SURFACE and _layer(m) is None]
    assert not missing, f"modules outside every layer (add them to LAYERS and docs/architecture.md): {missing}"


def test_no_import_goes_up_the_layers():
    wrong = []
    for module in MODULES.values():
        mine = _layer(module.name)
        if module.name in SURFACE or mine is None:
            continue
        for target, _, line in module.imports:
            theirs = _layer(target)
            if target in SURFACE or (theirs is not None and theirs > mine):
                wrong.append(f"{module.path.relative_to(ROOT.parent)}:{line} imports {target}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def _graph() -> dict[str, set[str]]:
    """Module -> modules it imports when it runs (imports only for type checkers are
    left out: they never execute)."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for module in MODULES.values():
        for target, _, line in module.imports:
            if target in MODULES and target != module.name and line not in module.typing_only:
                graph[module.name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert not _cycles(_graph()), f"import cycles (lazy imports count too): {_cycles(_graph())}"


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _private_owner(target: str, name: str | None) -> str | None:
    """The package an underscore module or name belongs to (None: not private)."""
    if name is not None and name.startswith("_") and not name.startswith("__"):
        return target if _is_module(target) and (ROOT.parent / pathlib.Path(*target.split("."))).is_dir() \
            else target.rpartition(".")[0]
    parts = target.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def test_underscore_names_stay_in_their_package():
    wrong = []
    for module in MODULES.values():
        for target, name, line in module.imports:
            owner = _private_owner(target, name)
            if owner is not None and not (module.name == owner or module.name.startswith(owner + ".")):
                what = f"{target}.{name}" if name else target
                wrong.append(f"{module.path.relative_to(ROOT.parent)}:{line} imports {what}")
    assert not wrong, "private names imported from another package:\n" + "\n".join(wrong)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    lines = len(MODULES[name].path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (> {MAX_LINES}): split it by concern"


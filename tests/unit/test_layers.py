"""The shape of the package (DESIGN.md §3): a one-way dependency order between its
layers, no import cycles (not even lazy imports inside functions), and no private name
imported across subpackages. Read from the source with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "rlinf"

#: Lowest first. A module may import only modules of its own layer or lower ones.
LAYERS = [
    ["rlinf.errors", "rlinf.config", "rlinf.info"],
    ["rlinf.util"],
    ["rlinf.codec"],
    ["rlinf.transports"],
    ["rlinf.control"],
    ["rlinf.core"],
    ["rlinf.collectives"],
    ["rlinf.channel"],
    ["rlinf.weights"],
    ["rlinf.communicator"],
    ["rlinf.launch"],
    ["rlinf.sync"],
    ["rlinf.tools"],
    ["rlinf.demo"],
    # entry points and the public surface: the root package, its aliases, the command line
    ["rlinf", "rlinf.__main__", "rlinf.routing", "rlinf.ray", "rlinf.manager", "rlinf.tools.cli"],
]

#: Known imports against the order, to be removed; nothing may be added here. The
#: transports read the message format (``core.wire``): its descriptor records move to
#: the transports (issue 22, item 5). ``ClusterKeys`` (``control.security``) secures the
#: ZeroMQ sockets: it belongs below the transports.
PENDING = {
    *((f"rlinf.transports.{m}", target) for m in ("stream", "tcp_bulk", "cuda.ipc", "shm._fdshare", "shm._pool",
                                                  "shm._pull", "shm._reader", "shm._session", "shm._transport")
      for target in ("rlinf.core", "rlinf.core.wire")),
    ("rlinf.transports.zeromq", "rlinf.control.security"),
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` for every import in the file, wherever it stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, [alias.name for alias in node.names]))
    return [(m, names) for m, names in found if m == "rlinf" or m.startswith("rlinf.")]


def _targets(module: str, names: list[str]) -> list[str]:
    """The rlinf modules an import depends on: ``from pkg import sub`` on ``pkg.sub``
    (and on ``pkg`` only for names defined there)."""
    subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
    if module in MODULES and (not names or len(subs) < len(names)):
        return [module, *subs]
    return subs


def _graph() -> dict[str, set[str]]:
    """Module -> the rlinf modules it imports, anywhere in it. A module's own packages
    are left out: Python initialises them before the module in any case."""
    graph = {}
    for name, path in MODULES.items():
        graph[name] = {t for module, names in _imports(name, path) for t in _targets(module, names)
                       if t != name and not name.startswith(t + ".")}
    return graph


def _layer(module: str) -> int:
    best, index = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    assert index is not None, f"{module} is in no layer: add it to LAYERS"
    return index


def _package(module: str) -> str:
    """The subpackage (or top-level module) ``module`` belongs to."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_follow_the_layer_order():
    wrong = []
    for name, targets in _graph().items():
        for target in targets:
            if _layer(target) > _layer(name) and target != "rlinf" and (name, target) not in PENDING:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_the_core_knows_nothing_above_it():
    above = ("rlinf.collectives", "rlinf.channel", "rlinf.weights", "rlinf.communicator", "rlinf.launch",
             "rlinf.sync", "rlinf.tools", "rlinf.demo")
    for name, targets in _graph().items():
        if name.startswith("rlinf.core"):
            assert not [t for t in targets if t.startswith(above)], name


def test_no_private_name_crosses_a_subpackage():
    crossing = []
    for name, path in MODULES.items():
        for module, names in _imports(name, path):
            if _package(module) == _package(name):
                continue
            private_module = any(part.startswith("_") and part != "__init__" for part in module.split(".")[1:])
            private_names = [n for n in names if n.startswith("_") and not n.endswith("__")]
            if private_module or private_names:
                crossing.append(f"{name}: from {module} import {', '.join(names)}")
    assert not crossing, "private names imported across subpackages:\n" + "\n".join(sorted(crossing))

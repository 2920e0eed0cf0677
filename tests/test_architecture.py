"""The house stays as built (docs/architecture.md): no import circle anywhere in ``sdlite/``, no import upward across
the layers, no file over 900 lines.

Every import counts, at module level or inside a function, ``TYPE_CHECKING`` blocks included: a lazy import that
only hides a circle is still one. Importing ``a.b.c`` from outside package ``a.b`` also runs ``a.b``'s and ``a``'s
``__init__``, so those edges count too. Run this file as a script to print the graph's circles and upward imports.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sdlite"

# Ground up. A module may import from its own layer or any layer below, never from one above. A module is placed by
# the longest prefix that names it or a package above it ("sdlite" names only the package's own __init__); every
# module must be placed.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("sdlite", "sdlite.errors", "sdlite.machine", "sdlite.config")),
    ("kernels", ("sdlite.kernels",)),
    ("models", ("sdlite.models", "sdlite.tokenizers", "sdlite.sampling", "sdlite.prompts")),
    ("weights", ("sdlite.weights", "sdlite.loader", "sdlite.export")),
    ("engine", ("sdlite.engine", "sdlite.upscalers")),
    ("images", ("sdlite.sources", "sdlite.images", "sdlite.hires")),
    ("adapters", ("sdlite.adapters", "sdlite.control")),
    ("families", ("sdlite.families", "sdlite.conditioning")),
    ("upscaling", ("sdlite.upscalers.registry", "sdlite.upscalers.x4", "sdlite.upscalers.extras")),
    ("pipeline", ("sdlite.pipeline",)),
    ("demo", ("sdlite.demo",)),   # the shipped demo model: its file, data and classifier (the server's default model)
    # the server's shared parts, then the protocols over them (docs/architecture.md, "The server"): A1111's contract
    # (its schemas and the plan an A1111, OpenAI or MCP request becomes) sits under the backend that runs the plans;
    # the protocols' routes sit on the backend; the app (the package's __init__ and app.py) assembles them
    ("server", ("sdlite.server.http", "sdlite.server.jobs", "sdlite.server.limits", "sdlite.server.decode",
                "sdlite.server.checkpoints")),
    ("a1111 contract", ("sdlite.server.a1111",)),
    ("backend", ("sdlite.server.backend",)),
    ("protocols", ("sdlite.server.a1111.routes", "sdlite.server.comfy", "sdlite.server.openai", "sdlite.server.mcp")),
    ("front-ends", ("sdlite.cli", "sdlite.server", "sdlite.scale", "sdlite.__main__")),
]
MAX_LINES = 900


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _owner(name: str, known) -> str | None:
    """The module that ``name`` (a module, or a name inside one) lives in."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports (directly, or as the packages an import from outside runs)."""
    known = modules(root)
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(_owner(a.name, known) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for a in node.names:
                    full = f"{base}.{a.name}"
                    targets.add(full if full in known else _owner(base, known))
        for target in targets - {None, name}:
            if not target.startswith("sdlite"):
                continue
            graph[name].add(target)
            # importing a.b.c from outside a.b runs a.b/__init__ (and a/__init__) first
            ancestors = set(_parents(name)) | {name}
            graph[name].update(p for p in _parents(target) if p not in ancestors)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def layer_of(name: str) -> int | None:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = name == prefix or (prefix != "sdlite" and name.startswith(prefix + "."))
            if inside and (best is None or len(prefix) > best[1]):
                best = (rank, len(prefix))
    return None if best is None else best[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for name in sorted(graph):
        for target in sorted(graph[name]):
            if None not in (layer_of(name), layer_of(target)) and layer_of(target) > layer_of(name):
                found.append(f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} "
                             f"({LAYERS[layer_of(target)][0]})")
    return found


def long_files(root: Path = PACKAGE) -> list[str]:
    return [f"{path.relative_to(root.parent)}: {n} lines" for path in sorted(root.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_LINES]


# --- the checks -------------------------------------------------------------------------------------------------

def test_every_module_has_a_layer():
    assert [name for name in modules() if layer_of(name) is None] == []


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_no_upward_import():
    assert upward_imports(import_graph()) == []


def test_no_file_over_900_lines():
    assert long_files() == []


def test_the_checker_sees_circles_and_upward_imports(tmp_path):
    """The checker itself: a planted circle through a function-level import and a package ``__init__``, and a
    planted upward import, are found."""
    root = tmp_path / "sdlite"
    (root / "models").mkdir(parents=True)
    (root / "engine").mkdir()
    (root / "__init__.py").write_text("")
    (root / "errors.py").write_text("")
    (root / "models" / "__init__.py").write_text("from .unet import UNet\n")
    (root / "models" / "unet.py").write_text("def f():\n    from ..engine.cpu import x\n")
    (root / "engine" / "__init__.py").write_text("")
    (root / "engine" / "cpu.py").write_text("from sdlite.models import layers\nfrom .. import errors\n")
    (root / "models" / "layers.py").write_text("import torch\n")
    graph = import_graph(root)
    assert graph["sdlite.engine.cpu"] == {"sdlite.models", "sdlite.models.layers", "sdlite.errors"}
    assert circles(graph) == [["sdlite.engine.cpu", "sdlite.models", "sdlite.models.unet"]]
    assert upward_imports(graph) == ["sdlite.models.unet (models) imports sdlite.engine (engine)",
                                     "sdlite.models.unet (models) imports sdlite.engine.cpu (engine)"]


if __name__ == "__main__":
    graph = import_graph(Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE)
    for component in circles(graph):
        print(f"circle of {len(component)}: {', '.join(component)}")
    print("\n".join(upward_imports(graph)))
    print("\n".join(long_files()))
    print("unplaced:", [name for name in modules() if layer_of(name) is None])

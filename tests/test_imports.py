"""The module graph: the floors of the package (docs/architecture.md) as a test. Every import is counted, at module
level or inside a function. A module may import a module of its own floor or of a floor below, never one above; the
rooms of one floor never import each other in a circle; no two modules import each other, directly or through a
chain; and every module imports on its own (no cycle hides behind an import order). The command line (``cli/``)
alone imports inside functions, so that ``mlx-llm --help`` imports no jax."""

import ast
import json
from collections import defaultdict
from pathlib import Path

import pytest

from helpers import python

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_llm"
# The floors, from the ground up: a room is a top-level module or package of mlx_llm.
FLOORS = [
    ("errors", "settings", "ops", "gradcheck", "stats"),
    ("kernels",),
    ("layers",),
    ("config",),
    ("model", "lora", "examples", "recipes"),
    ("objectives", "scaling", "decode"),
    ("data",),
    ("train",),
    ("runs",),
    ("eval",),
    ("post", "interop"),
    ("serve",),
    ("cli", "__main__"),
]
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
LAZY_ALLOWED = {"cli"}  # `mlx-llm --help` imports no jax: the commands import the library when they run


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path, known: dict) -> list[tuple[str, bool]]:
    """[(imported mlx_llm module, inside a function)] of one file; `from pkg import name` resolves to the module
    pkg.name when there is one, else to pkg."""
    tree = ast.parse(path.read_text())
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in inner) for a in node.names if a.name.startswith("mlx_llm")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_llm") and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.append((full if full in known else node.module, id(node) in inner))
    return out


def graph() -> dict[str, list[tuple[str, bool]]]:
    known = modules()
    return {name: imports_of(path, known) for name, path in known.items()}


def test_every_room_has_a_floor():
    rooms = {room(m) for m in modules()} - {"__init__"}
    assert rooms - set(FLOOR) == set(), "a new room: give it a floor in FLOORS and in docs/architecture.md"
    assert set(FLOOR) - rooms == set(), "a floor names a room that no longer exists"


def test_no_module_imports_a_higher_floor():
    climbs = [f"{a} -> {b}" for a, deps in graph().items() if room(a) != "__init__"
              for b, _ in deps if FLOOR.get(room(b), -1) > FLOOR[room(a)]]
    assert climbs == []


def test_rooms_of_one_floor_form_no_circle():
    edges = defaultdict(set)
    for a, deps in graph().items():
        for b, _ in deps:
            if room(a) != room(b) and "__init__" not in (room(a), room(b)):
                edges[room(a)].add(room(b))
    pairs = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges.get(b, ())})
    assert pairs == [], "two rooms import each other"
    assert _cycles(edges) == []


def test_no_module_circle():
    edges = {a: {b for b, _ in deps if b != a} for a, deps in graph().items()}
    assert _cycles(edges) == []


def _cycles(edges) -> list[list[str]]:
    """Every cycle found by a depth-first search (one per back edge)."""
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_the_floor_test_catches_what_it_should():
    """The checks themselves: a climbing import, a circle of rooms and a circle of files are found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    fake = {"mlx_llm.ops": [("mlx_llm.train.step", False)]}
    climbs = [f"{a} -> {b}" for a, deps in fake.items() for b, _ in deps if FLOOR[room(b)] > FLOOR[room(a)]]
    assert climbs == ["mlx_llm.ops -> mlx_llm.train.step"]


@pytest.mark.parametrize("name", sorted(modules()), ids=lambda n: n)
def test_no_module_imports_another_inside_a_function(name):
    inside = [b for b, lazy in graph_cached()[name] if lazy]
    if room(name) in LAZY_ALLOWED:
        return
    assert inside == []


_GRAPH = {}


def graph_cached():
    if not _GRAPH:
        _GRAPH.update(graph())
    return _GRAPH


def test_the_command_line_imports_lazily():
    lazy = [b for a, deps in graph().items() if room(a) == "cli" for b, inside in deps if inside]
    assert lazy, "cli/ no longer needs to import inside functions: remove it from LAZY_ALLOWED and the docs"


ALONE = """
import importlib, json, sys
failures = {}
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "mlx_llm" or m.startswith("mlx_llm.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as exc:
        failures[name] = type(exc).__name__ + ": " + str(exc)
print(json.dumps(failures))
"""


@pytest.mark.slow
def test_every_module_imports_alone():
    """Each module imported with no mlx_llm module loaded before it, in a fresh interpreter (third-party modules
    stay loaded between modules: the question is the order of mlx_llm's own imports)."""
    names = [n for n in modules() if not n.endswith("__main__")]
    proc = python("-c", ALONE, *names)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}
    assert len(names) > 60

"""The module graph: every module of mlx_llm imports on its own (no cycle hides behind an import order), and no
module imports another inside a function except where the README says why (the CLI's commands, so that
`mlx-llm --help` imports no jax)."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_llm"
LAZY_ALLOWED = {"cli/commands.py"}  # README, "Runs": `mlx-llm --help` imports no jax


def modules() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if rel.name != "__main__":
            out.append(".".join(parts))
    return out


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
    names = modules()
    proc = subprocess.run([sys.executable, "-c", ALONE, *names], capture_output=True, text=True, timeout=600,
                          cwd=PACKAGE.parent, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}
    assert len(names) > 60


def function_level_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                names = ([a.name for a in inner.names] if isinstance(inner, ast.Import) else
                         [inner.module or ""] if isinstance(inner, ast.ImportFrom) else [])
                found += [f"{node.name}: {n}" for n in names if n.startswith("mlx_llm")]
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_another_inside_a_function(path):
    rel = str(path.relative_to(PACKAGE))
    found = function_level_imports(path)
    if rel in LAZY_ALLOWED:
        assert found, f"{rel} no longer needs its exception: remove it from LAZY_ALLOWED and the README"
    else:
        assert found == []

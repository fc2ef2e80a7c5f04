"""The docs site (mkdocs.yml, docs/) and the README: the strict build passes, every command and every result file
the pages name exists, the pages that quote measurements cite where they come from, and the README stays short."""

import ast
import re
from pathlib import Path

import pytest
from helpers import python, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / "experiments" / "results"
README_MAX_LINES = 250
# Pages that quote numbers measured by the experiments: each cites the result files under experiments/results/.
MEASURED_PAGES = ["index.md", "training.md", "runs.md", "scaling-out.md", "variants.md", "post-training.md",
                  "scaling-laws.md", "measurements.md"]
# Pages whose measured numbers are what tests assert (no experiment writes them): each cites those tests.
TESTED_PAGES = {"generation.md": "tests/test_lm_eval.py", "interop.md": "tests/test_hf_interop.py"}
# Dotted names in the pages that are not ours: file names, and transformers' tensor names (interop.md).
NOT_NAMES = re.compile(r"\.(?:json|py|md|safetensors)$|^model\.norm$")
ROOMS = ("errors", "settings", "ops", "kernels", "layers", "config", "model", "lora", "examples", "recipes",
         "objectives", "scaling", "decode", "data", "train", "runs", "eval", "post", "interop", "cli")


def pages() -> dict[str, str]:
    return {str(p.relative_to(DOCS)): p.read_text() for p in sorted(DOCS.rglob("*.md"))}


def texts() -> dict[str, str]:
    return {**{f"docs/{k}": v for k, v in pages().items()}, "README.md": (ROOT / "README.md").read_text()}


def exists(path: str) -> bool:
    """A file of the repository at ``path`` or ending in it (``runs/resume.py`` is mlx_llm/runs/resume.py)."""
    return (ROOT / path).is_file() or any(next((ROOT / top).rglob(path), None) is not None
                                          for top in ("mlx_llm", "tests", "experiments", "notebooks", "docs"))


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a page missing from the navigation, a docstring the API
    reference cannot render, or a plot that is not where a page embeds it fails the build."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    proc = python("-m", "mkdocs", "build", "--strict", "-f", ROOT / "mkdocs.yml", "-d", site,
                  env=subprocess_env(NO_MKDOCS_2_WARNING=1))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    for png in sorted(RESULTS.glob("*.png")):  # served from experiments/results/ by docs/hooks.py
        built = site / "experiments" / "results" / png.name
        assert built.read_bytes() == png.read_bytes()
    assert "experiments/results/fitted_surface.png" in (site / "scaling-laws" / "index.html").read_text()
    api = (site / "api" / "model" / "index.html").read_text()
    assert "mlx_llm.model" in api and "init_params" in api and "ModelConfig" in api


def test_every_subcommand_appears_in_the_docs():
    from mlx_llm.cli.parser import build_parser, subcommands

    names = sorted(subcommands(build_parser()))
    assert len(names) > 10
    text = "\n".join(pages().values())
    missing = [n for n in names if not re.search(rf"mlx-llm {re.escape(n)}(?![\w-])", text)]
    assert missing == []


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_the_test_command_is_what_ci_runs():
    ci = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l.startswith("python3 -m venv")]
    assert len(ci) == 1 and "docs" in ci[0]
    for name in ("README.md", "docs/index.md", "docs/testing.md"):
        assert ci[0] in (ROOT / name).read_text().splitlines(), name


def test_every_cited_result_file_exists():
    cited = {(name, m.rstrip(".")) for name, text in texts().items()
             for m in re.findall(r"experiments/results/([\w.*<>\-]+)", text)}
    assert len(cited) > 30
    missing = [(name, f) for name, f in sorted(cited) if "<" not in f and not list(RESULTS.glob(f))]
    assert missing == []


def test_every_plot_is_embedded():
    embedded = set(re.findall(r"!\[[^\]]*\]\(experiments/results/([\w.\-]+\.png)\)", "\n".join(pages().values())))
    assert {p.name for p in RESULTS.glob("*.png")} - embedded == set()


@pytest.mark.parametrize("page", MEASURED_PAGES)
def test_a_page_with_measurements_cites_its_result_files(page):
    assert "experiments/results/" in pages()[page]


@pytest.mark.parametrize("page", sorted(TESTED_PAGES))
def test_a_page_with_tested_numbers_cites_its_tests(page):
    assert TESTED_PAGES[page] in pages()[page] and (ROOT / TESTED_PAGES[page]).is_file()


def test_every_cited_file_exists():
    """A path like `runs/resume.py` or `mlx_llm/data/text.py` names a file of the repository (the end of its
    path), so a module that moved cannot stay cited at its old place."""
    cited = {(name, m) for name, text in texts().items()
             for m in re.findall(r"`([\w./\-]+\.(?:py|ipynb|json|csv|png|jsonl|md))`", text)}
    placeholder = re.compile(r"^(?:[A-Z_]+/|runs/run-|\.\./)")  # RUN/trackers.json, a run's own files, ../shared
    stale = [(name, p) for name, p in sorted(cited) if "/" in p and not placeholder.match(p) and not exists(p)]
    assert stale == []


def _defined(module: Path) -> set[str]:
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_cited_library_name_exists():
    """A dotted name like `layers.moe.route` or `mlx_llm.train.optim.make_optimizer` is a module of the package and a
    name that module defines or imports (read from its syntax tree, nothing imported)."""
    pattern = rf"`(?:mlx_llm\.)?((?:{'|'.join(ROOMS)})(?:\.\w+)+)(?:\(|`)"
    cited = {(name, m) for name, text in texts().items() for m in re.findall(pattern, text) if not NOT_NAMES.search(m)}
    assert len(cited) > 40
    wrong = []
    for name, dotted in sorted(cited):
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            base = ROOT / "mlx_llm" / Path(*parts[:i])
            module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
            if module.is_file():
                rest = parts[i:]
                if rest and rest[0] not in _defined(module) and not (base / f"{rest[0]}.py").is_file():
                    wrong.append((name, dotted))
                break
        else:
            wrong.append((name, dotted))
    assert wrong == []

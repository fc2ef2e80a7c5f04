"""SEED_INDEX.md stays true: every test it names exists, every section of both seed texts has a row, and no row
names a section the texts do not have.

Tests are found by parsing the test files with ``ast`` (top-level ``def test_*``), never by running pytest. The
sections are parsed from the seed texts themselves: Module 20 numbers its headings ("12. AdamW turns …"); each
Unit 19 section is the title line just before its "Imagine this", and its practice problems are headed
"Problem 7mediumtop-k and top-p" (number, difficulty, topic).
"""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INDEX = REPO / "SEED_INDEX.md"
SEEDS = REPO.parent / "shared" / "seeds"  # the shared folder sits beside the repository
M20 = SEEDS / "000_a3e8d729c646ca10.txt"
U19 = SEEDS / "003_4297aa912ac6597b.txt"
NODE_ID = re.compile(r"\b(tests/[\w/]+\.py)::(\w+)")
NO_NUMBER = "no worked number"


# ----- parsers -------------------------------------------------------------------------------------------------
def collect_test_names(path: Path) -> set[str]:
    """Names of the top-level ``def test_*`` functions of a test file (parametrised tests by their base name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return {node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}


def unknown_ids(text: str, root: Path = REPO) -> list[str]:
    """Every node id ``tests/x.py::test_y`` in ``text`` whose file or function does not exist, in order."""
    found: dict[str, set[str]] = {}
    missing = []
    for rel, name in NODE_ID.findall(text):
        path = root / rel
        if rel not in found:
            found[rel] = collect_test_names(path) if path.is_file() else set()
        if name not in found[rel]:
            missing.append(f"{rel}::{name}")
    return missing


def index_rows(text: str) -> dict[str, tuple[str, str]]:
    """{section label: (heading, tests cell)} of the index's table rows (header and separator rows skipped)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 3 or cells[0] == "Section" or set(cells[0]) <= set("-:"):
            continue
        assert cells[0] not in rows, f"section {cells[0]} has two rows in {INDEX.name}"
        rows[cells[0]] = (cells[1], cells[2])
    return rows


def m20_sections(text: str) -> list[tuple[str, str]]:
    """[("M20 §n", heading)] from Module 20's numbered headings "n. Heading"."""
    return [(f"M20 §{n}", title.strip()) for n, title in re.findall(r"^(\d+)\. (\S.*)$", text, re.M)]


def u19_sections(text: str) -> list[tuple[str, str]]:
    """[("U19 §i", heading)] — the title line before each "Imagine this" — then [("U19 Pn", topic)]."""
    lines = text.splitlines()
    sections = []
    for i, line in enumerate(lines):
        if line.strip() == "Imagine this":
            j = i - 1
            while not lines[j].strip():
                j -= 1
            sections.append((f"U19 §{len(sections) + 1}", lines[j].strip()))
    problems = re.findall(r"^Problem (\d+)(?:easy|medium|hard)(.+)$", text, re.M)
    return sections + [(f"U19 P{n}", topic.strip()) for n, topic in problems]


def seed_sections() -> list[tuple[str, str]]:
    if not (M20.is_file() and U19.is_file()):
        pytest.skip(f"seed texts not found under {SEEDS} (the shared folder sits beside the repo)")
    return m20_sections(M20.read_text(encoding="utf-8")) + u19_sections(U19.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def index_text() -> str:
    return INDEX.read_text(encoding="utf-8")


# ----- the index against the tests ------------------------------------------------------------------------------
def test_every_test_named_in_the_index_exists(index_text):
    assert len(NODE_ID.findall(index_text)) > 150  # the parser found the ids (a format change cannot hide them)
    assert unknown_ids(index_text) == []


def test_the_checker_catches_misspelt_and_missing_tests():
    text = ("`tests/test_seed_u19.py::test_u19_p1_next_token` `tests/test_seed_u19.py::test_u19_p1_next_tokn` "
            "`tests/test_no_such_file.py::test_x` `tests/test_seed_u19.py::helpers_not_a_test`")
    assert unknown_ids(text) == ["tests/test_seed_u19.py::test_u19_p1_next_tokn", "tests/test_no_such_file.py::test_x",
                                 "tests/test_seed_u19.py::helpers_not_a_test"]
    assert unknown_ids("`tests/test_seed_u19.py::q_of`") == ["tests/test_seed_u19.py::q_of"]  # a helper is no test


def test_nested_and_non_test_functions_are_not_tests(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "def test_a():\n    def test_inner():\n        pass\n\nclass C:\n    def test_m(self):\n        pass\n\n"
        "def helper():\n    pass\n\nasync def test_b():\n    pass\n")
    assert collect_test_names(tmp_path / "tests" / "test_x.py") == {"test_a", "test_b"}
    ids = "tests/test_x.py::test_inner tests/test_x.py::test_b"
    assert unknown_ids(ids, tmp_path) == ["tests/test_x.py::test_inner"]


def test_every_unit_19_seed_test_is_in_the_index(index_text):
    listed = {name for rel, name in NODE_ID.findall(index_text) if rel == "tests/test_seed_u19.py"}
    assert sorted(collect_test_names(REPO / "tests" / "test_seed_u19.py") - listed) == []


def test_every_row_names_tests_or_says_it_has_no_worked_number(index_text):
    rows = index_rows(index_text)
    assert rows, f"no table rows found in {INDEX.name}"
    empty = [label for label, (_, tests) in rows.items() if not NODE_ID.search(tests) and NO_NUMBER not in tests]
    assert empty == []


# ----- the index against the seed texts -------------------------------------------------------------------------
def test_the_seed_parsers_find_every_section():
    sections = seed_sections()
    labels = [label for label, _ in sections]
    assert labels[:16] == [f"M20 §{n}" for n in range(1, 17)] and labels[16:18] == ["M20 §19", "M20 §20"]
    assert labels[18:31] == [f"U19 §{n}" for n in range(1, 14)]
    assert labels[31:] == [f"U19 P{n}" for n in range(1, 17)]
    headings = dict(sections)
    assert headings["U19 §2"] == "Scoring a whole sentence: likelihood, loss and perplexity"
    assert headings["U19 P7"] == "top-k and top-p" and headings["M20 §12"] == "AdamW turns derivatives into a new model"


def test_every_section_of_both_texts_has_a_row_with_its_heading(index_text):
    rows = index_rows(index_text)
    missing = [f"{label} {heading}" for label, heading in seed_sections() if label not in rows]
    assert missing == []
    wrong = [(label, rows[label][0], heading) for label, heading in seed_sections() if rows[label][0] != heading]
    assert wrong == []


def test_no_row_for_a_section_the_texts_do_not_have(index_text):
    known = {label for label, _ in seed_sections()}
    assert sorted(set(index_rows(index_text)) - known) == []

"""Built-in fine-tuning tasks: determinism, split hygiene, correct answers, the exact checker, JSONL, errors."""

import hashlib
import json
import re

import pytest

from helpers import python, subprocess_env

from mlx_llm.errors import ConfigError
from mlx_llm.data import tasks as K
from mlx_llm.data.text import read_corpus

QUESTION = re.compile(r"What is (\d+) ([+-]) (\d+)\?")
DOCSTRING = re.compile(re.escape(K.NAME_FUNCTION_QUESTION) + '\n"""(.*)"""', re.S)


def question(example):
    return example["messages"][0]["content"]


def docstring(example):
    return DOCSTRING.fullmatch(question(example)).group(1)


def digest(records):
    return hashlib.sha256(json.dumps(records, ensure_ascii=False).encode("utf-8")).hexdigest()


@pytest.fixture(scope="module")
def stdlib():
    return read_corpus(None, extensions=(".py",), val_percent=5.0)


# ----- determinism and splits ---------------------------------------------------------------------
DIGEST_ARGS = [("arithmetic", "train", 2000), ("arithmetic", "heldout", 500), ("addition2", "heldout", None),
               ("name_function", "heldout", None), ("name_function", "train", 300)]
DIGESTS = f"""
import hashlib, json
from mlx_llm.data import tasks as K
for task, split, n in {DIGEST_ARGS!r}:
    print(hashlib.sha256(json.dumps(K.examples(task, split, n=n), ensure_ascii=False).encode()).hexdigest())
"""


@pytest.mark.slow
def test_deterministic_within_and_across_processes():
    here = [digest(K.examples(task, split, n=n)) for task, split, n in DIGEST_ARGS]
    assert here == [digest(K.examples(task, split, n=n)) for task, split, n in DIGEST_ARGS]
    out = python("-c", DIGESTS, env=subprocess_env(PYTHONHASHSEED=12345))  # hash() must play no part
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == here


def test_addition2_split_is_pinned():
    """The split rule is SHA-256 of the problem text: these numbers hold on every machine."""
    train, heldout = K.examples("addition2", "train"), K.examples("addition2", "heldout")
    assert (len(train), len(heldout)) == (7317, 783)
    assert question(heldout[0]) == "What is 10 + 28?" and question(train[0]) == "What is 10 + 10?"


@pytest.mark.parametrize("task", ["arithmetic", "addition2"])
def test_arithmetic_train_and_heldout_disjoint(task):
    train = {question(e) for e in K.examples(task, "train")}
    heldout = {question(e) for e in K.examples(task, "heldout")}
    assert train and heldout and not train & heldout
    # other seeds draw other samples of the same split
    assert not {question(e) for e in K.examples(task, "heldout", n=300, seed=7)} & train


def test_addition2_heldout_never_in_arithmetic_train():
    """One split rule for both tasks: ~1,000 of the arithmetic train sample are 2-digit additions."""
    arith_train = {question(e) for e in K.examples("arithmetic", "train")}
    add2_heldout = {question(e) for e in K.examples("addition2", "heldout")}
    add2_train = {question(e) for e in K.examples("addition2", "train")}
    assert len(arith_train & add2_train) > 500
    assert not arith_train & add2_heldout


def test_name_function_train_and_heldout_disjoint():
    train = K.examples("name_function", "train")
    heldout = K.examples("name_function", "heldout")
    assert len(train) > 1000 and len(heldout) > 20
    pairs = {split: [(docstring(e), e["answer"]) for e in ex] for split, ex in (("train", train), ("heldout", heldout))}
    assert all(len(set(p)) == len(p) for p in pairs.values())  # deduplicated
    assert not set(pairs["train"]) & set(pairs["heldout"])
    assert pairs["train"] == sorted(pairs["train"], key=lambda p: (p[1], p[0]))  # sorted by (name, docstring)


# ----- arithmetic content -------------------------------------------------------------------------
@pytest.mark.parametrize("split", ["train", "heldout"])
def test_arithmetic_answers_and_ranges(split):
    ex = K.examples("arithmetic", split)
    assert len(ex) == K.ARITHMETIC_DEFAULT_N[split]
    ops, digits = set(), set()
    for e in ex:
        a, op, b = QUESTION.fullmatch(question(e)).groups()
        a, b = int(a), int(b)
        assert 0 <= a <= 999 and 0 <= b <= 999
        assert e["answer"] == str(a + b if op == "+" else a - b) == e["messages"][1]["content"]
        assert [m["role"] for m in e["messages"]] == ["user", "assistant"]
        ops.add(op)
        digits.update({len(str(a)), len(str(b))})
    assert ops == {"+", "-"} and digits == {1, 2, 3}
    assert any(e["answer"].startswith("-") for e in ex)


def test_addition2_answers_and_ranges():
    ex = K.examples("addition2", "train") + K.examples("addition2", "heldout")
    problems = set()
    for e in ex:
        a, op, b = QUESTION.fullmatch(question(e)).groups()
        assert op == "+" and 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert e["answer"] == str(int(a) + int(b))
        problems.add((a, b))
    assert len(problems) == len(ex) == 90 * 90


def test_n_and_seed():
    full = K.examples("addition2", "heldout")
    sub = K.examples("addition2", "heldout", n=100, seed=3)
    assert len(sub) == 100 and all(e in full for e in sub)
    assert sub == K.examples("addition2", "heldout", n=100, seed=3)
    assert sub != K.examples("addition2", "heldout", n=100, seed=4)
    assert K.examples("addition2", "heldout", n=10**6) == full  # n caps
    assert len(K.examples("arithmetic", "heldout", n=37)) == 37
    assert K.examples("arithmetic", "train", n=500, seed=1) != K.examples("arithmetic", "train", n=500, seed=2)


# ----- name the function --------------------------------------------------------------------------
_DEFINERS: dict[int, tuple[list, dict[str, list]]] = {}  # id(docs) → (docs, kept alive so the id stays theirs; index)


def defined_in(example, docs) -> bool:
    """Some document defines the name and holds every word of the docstring's first line (escapes aside). The
    documents that define each name are indexed once per list (one scan of the corpus, not one per example)."""
    name, words = example["answer"], re.findall(r"\w+", docstring(example).splitlines()[0])
    if _DEFINERS.get(id(docs), (None,))[0] is not docs:
        index: dict[str, list] = {}
        for d in docs:
            for defined in set(re.findall(r"def\s+(\w+)\s*\(", d.text)):
                index.setdefault(defined, []).append(d)
        _DEFINERS[id(docs)] = (docs, index)
    return any(all(w in d.text for w in words) for d in _DEFINERS[id(docs)][1].get(name, ()))


@pytest.mark.slow
def test_name_function_split_by_file(stdlib):
    heldout = K.examples("name_function", "heldout")
    train = K.examples("name_function", "train")
    assert stdlib.val and all(defined_in(e, stdlib.val) for e in heldout)
    assert all(defined_in(e, stdlib.train) for e in train[::25])
    # the check can fail: most heldout functions are not in train files
    assert sum(defined_in(e, stdlib.train) for e in heldout) < len(heldout) / 2


def test_name_function_content():
    for e in K.examples("name_function", "train") + K.examples("name_function", "heldout"):
        name, text = e["answer"], docstring(e)
        assert name.isidentifier() and e["messages"][1]["content"] == name
        assert name.lower() not in text.lower()
        assert K.MIN_DOCSTRING_CHARS <= len(text) <= K.MAX_DOCSTRING_CHARS


# ----- checker, prompts, JSONL, errors ------------------------------------------------------------
@pytest.mark.parametrize(
    "answer, expected, ok",
    [
        ("432", "432", True),
        (" 432\n", "432", True),
        ("-5", "-5", True),
        ("0", "0", True),
        ("0432", "432", False),  # canonical form only: no leading zeros
        ("432.0", "432", False),
        ("+432", "432", False),
        ("the answer is 432", "432", False),
        ("432 ", "433", False),
        ("5", "-5", False),
        ("-0", "0", False),
        ("4 32", "432", False),
        ("", "0", False),
    ],
)
def test_check_arithmetic(answer, expected, ok):
    assert K.check("arithmetic", answer, expected) is ok
    assert K.check("addition2", answer, expected) is ok


def test_check_name_function():
    assert K.check("name_function", "urlencode", "urlencode")
    assert K.check("name_function", "  urlencode\n", "urlencode")
    for wrong in ["urlencode()", "urllib.parse.urlencode", "UrlEncode", "`urlencode`", "urlencod", ""]:
        assert not K.check("name_function", wrong, "urlencode")


def test_prompt_messages():
    e = K.examples("addition2", "heldout")[0]
    assert K.prompt_messages(e) == [{"role": "user", "content": "What is 10 + 28?"}]
    assert len(e["messages"]) == 2  # not modified
    assert K.prompt_messages({"messages": e["messages"][:1]}) == e["messages"][:1]


@pytest.mark.parametrize("task", K.TASKS)
def test_write_jsonl_round_trip(tmp_path, task):
    path = tmp_path / "sub" / f"{task}.jsonl"
    count = K.write_jsonl(task, "heldout", path, n=40, seed=1)
    expected = K.examples(task, "heldout", n=40, seed=1)
    text = path.read_text(encoding="utf-8")
    assert count == len(expected) == 40 == len(text.splitlines())
    assert text == "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in expected)  # not ASCII-escaped
    for line, e in zip(text.splitlines(), expected):
        record = json.loads(line)
        assert record == e
        assert [m["role"] for m in record["messages"]] == ["user", "assistant"]
        assert all(set(m) == {"role", "content"} for m in record["messages"])
        assert record["answer"] == record["messages"][-1]["content"]


def test_write_jsonl_keeps_non_ascii(tmp_path, monkeypatch):
    """No stdlib docstring kept today is non-ASCII, so a user's replacement data stands in."""
    record = {"messages": [{"role": "user", "content": "Café: 2 × 3?"}, {"role": "assistant", "content": "6"}],
              "answer": "6"}
    monkeypatch.setattr(K, "examples", lambda *args, **kwargs: [record])
    assert K.write_jsonl("arithmetic", "train", tmp_path / "x.jsonl") == 1
    text = (tmp_path / "x.jsonl").read_text(encoding="utf-8")
    assert "Café: 2 × 3?" in text and json.loads(text) == record


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: K.examples("foo", "train"),
         "task = 'foo' is invalid: valid tasks are ['arithmetic', 'addition2', 'name_function']"),
        (lambda: K.examples("arithmetic", "test"), "split = 'test' is invalid: valid splits are ['train', 'heldout']"),
        (lambda: K.examples("addition2", "train", n=0), "n = 0 is invalid"),
        (lambda: K.examples("addition2", "train", n=2.5), "n = 2.5 is invalid"),
        (lambda: K.examples("arithmetic", "heldout", n=10**6), "n = 1000000 is invalid for arithmetic heldout"),
        (lambda: K.examples("addition2", "train", seed=-1), "seed = -1 is invalid"),
        (lambda: K.check("Arithmetic", "1", "1"), "task = 'Arithmetic' is invalid"),
        (lambda: K.write_jsonl("foo", "train", "/nonexistent/x.jsonl"), "task = 'foo' is invalid"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ConfigError) as err:
        call()
    assert message in str(err.value)

"""A snapshot of the Hugging Face hub cache imports (interop/hf.py, data/hf_tokenizer.py).

Every ``huggingface_hub`` download has the layout ``models--ORG--NAME/{blobs/<sha256>, refs/main,
snapshots/<rev>/<file> -> ../../blobs/<sha256>}``, and ``snapshots/<rev>`` is the directory transformers loads.
Its links stay inside the repository's ``blobs/``, so they are followed; a link that leads anywhere else (another
repository's blobs, another snapshot, a file outside the cache), or a link leaving a plain directory, is refused in
one line naming the link and its target, and the refusal writes nothing. No torch: tiny exports of random weights."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import TINY_CFG, assert_trees_equal, cli_in_process, snapshot
from mlx_llm.config import ModelConfig

REV = "0123456789abcdef0123456789abcdef01234567"


def refused(*args) -> str:
    """The one line of an import that must refuse (status 2)."""
    proc = cli_in_process(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlx-llm import: error:"), proc.stderr[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A tiny Llama checkpoint directory as `mlx-llm export` writes it (random weights, the byte tokenizer)."""
    import jax

    from mlx_llm import init_params
    from mlx_llm.data.tokenizer import ByteTokenizer
    from mlx_llm.interop.hf import export_model

    tok = ByteTokenizer()
    cfg = ModelConfig(**{**TINY_CFG, "vocab_size": tok.vocab_size})
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(3)))
    return export_model(params, cfg, tok, tmp_path_factory.mktemp("hub") / "plain")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hub_repo(plain: Path, cache: Path, name: str = "models--org--tiny") -> Path:
    """``cache/name`` in the hub's layout: each file of ``plain`` moved into blobs/<sha256> and linked back from
    snapshots/REV by the relative link the hub writes; returns the snapshot directory."""
    repo = cache / name
    snap = repo / "snapshots" / REV
    for d in (repo / "blobs", repo / "refs", snap):
        d.mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    for f in sorted(plain.iterdir()):
        shutil.copy(f, repo / "blobs" / sha256(f))
        (snap / f.name).symlink_to(Path("..", "..", "blobs", sha256(f)))
    return snap


def continuation(run: Path) -> list[int]:
    proc = cli_in_process("generate", "--run", run, "--prompt", "def ", "--max-new-tokens", 6, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["continuation_ids"]


@pytest.mark.slow  # two imports and two decodes through the CLI (about 7 s on 2 cores)
def test_a_hub_snapshot_imports_and_decodes_like_a_plain_copy(plain, tmp_path):
    from mlx_llm.runs.load import load_params

    snap = hub_repo(plain, tmp_path / "cache")
    assert all((snap / f.name).is_symlink() for f in plain.iterdir())
    for src, out in ((plain, tmp_path / "from_plain"), (snap, tmp_path / "from_hub")):
        proc = cli_in_process("import", "--from", src, "--out", out)
        assert proc.returncode == 0 and "wrote" in proc.stdout, proc.stderr
    assert_trees_equal(load_params(tmp_path / "from_plain"), load_params(tmp_path / "from_hub"))
    assert (tmp_path / "from_plain" / "tokenizer.json").read_bytes() == (
        tmp_path / "from_hub" / "tokenizer.json").read_bytes()
    tokens = continuation(tmp_path / "from_plain")
    assert len(tokens) == 6 and continuation(tmp_path / "from_hub") == tokens


def test_a_sharded_hub_snapshot_imports(plain, tmp_path):
    """The index and its shard are links into blobs/ too (a sharded download)."""
    from mlx_llm.runs.load import load_params

    from safetensors.numpy import load_file

    src = tmp_path / "sharded"
    shutil.copytree(plain, src)
    shard = "model-00001-of-00001.safetensors"
    (src / "model.safetensors").rename(src / shard)
    weight_map = {name: shard for name in load_file(str(src / shard))}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    snap = hub_repo(src, tmp_path / "cache")
    proc = cli_in_process("import", "--from", snap, "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    proc = cli_in_process("import", "--from", plain, "--out", tmp_path / "plain_run")
    assert proc.returncode == 0, proc.stderr
    assert_trees_equal(load_params(tmp_path / "run"), load_params(tmp_path / "plain_run"))


def _relink(snap: Path, name: str, target) -> None:
    (snap / name).unlink()
    (snap / name).symlink_to(target)


def test_links_leaving_the_repository_blobs_are_refused_naming_link_and_target(plain, tmp_path):
    """Each case: the link named, its resolved target named, one line, status 2, nothing written anywhere."""
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    cases = []
    # a link into another repository's blobs
    snap = hub_repo(plain, tmp_path / "c1")
    other = hub_repo(plain, tmp_path / "c1", "models--org--other")
    target = other.parent.parent / "blobs" / sha256(plain / "config.json")
    _relink(snap, "config.json", Path("..", "..", "..", "models--org--other", "blobs", target.name))
    cases.append((snap, "config.json", target))
    # a link to a file outside the cache
    snap = hub_repo(plain, tmp_path / "c2")
    _relink(snap, "tokenizer.json", secret)
    cases.append((snap, "tokenizer.json", secret))
    # a link inside the repository but not into blobs/ (another snapshot's file, itself a link into blobs/, is fine;
    # refs/main is not a blob)
    snap = hub_repo(plain, tmp_path / "c3")
    _relink(snap, "tokenizer_config.json", Path("..", "..", "refs", "main"))
    cases.append((snap, "tokenizer_config.json", snap.parent.parent / "refs" / "main"))
    # the weights linked to a file beside the snapshot
    snap = hub_repo(plain, tmp_path / "c4")
    beside = snap.parent / "weights.safetensors"
    shutil.copy(plain / "model.safetensors", beside)
    _relink(snap, "model.safetensors", Path("..", "weights.safetensors"))
    cases.append((snap, "model.safetensors", beside))
    # a plain directory (not a hub snapshot) whose files link to a blobs/ beside it
    repo = tmp_path / "c5"
    hub_repo(plain, repo)
    flat = repo / "flat"
    flat.mkdir()
    for f in plain.iterdir():
        (flat / f.name).symlink_to(Path("..", "models--org--tiny", "blobs", sha256(f)))
    cases.append((flat, "config.json", repo / "models--org--tiny" / "blobs" / sha256(plain / "config.json")))
    for k, (src, link, target) in enumerate(cases):
        root = tmp_path / f"c{k + 1}"
        before = snapshot(root)
        line = refused("import", "--from", src, "--out", tmp_path / f"run{k}")
        assert f"names '{link}', which is outside" in line and f"a link to {target.resolve()}" in line, line
        assert snapshot(root) == before and not (tmp_path / f"run{k}").exists()


def test_blobs_that_are_a_link_and_names_that_climb_into_blobs_are_refused(plain, tmp_path):
    """The repository's blobs/ must be a directory of its own (a link there could lead anywhere), and a file name
    read from the snapshot (an index's shard) may not climb out of it, even into blobs/."""
    snap = hub_repo(plain, tmp_path / "c1")
    repo = snap.parent.parent
    (repo / "blobs").rename(tmp_path / "elsewhere")
    (repo / "blobs").symlink_to(tmp_path / "elsewhere")
    before = snapshot(tmp_path / "c1")
    line = refused("import", "--from", snap, "--out", tmp_path / "run")
    assert "names 'config.json', which is outside" in line and "a link to " + str(tmp_path / "elsewhere") in line
    assert snapshot(tmp_path / "c1") == before and not (tmp_path / "run").exists()

    snap = hub_repo(plain, tmp_path / "c2")
    shard = "../../blobs/" + sha256(plain / "model.safetensors")
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))
    before = snapshot(tmp_path / "c2")
    line = refused("import", "--from", snap, "--out", tmp_path / "run")
    assert f"names '{shard}', which is outside" in line
    assert snapshot(tmp_path / "c2") == before and not (tmp_path / "run").exists()

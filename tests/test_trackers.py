"""Experiment trackers (mlx_llm/train/trackers.py): what tensorboardX and W&B were sent, read back with their own
formats — TensorBoard's EventAccumulator, and the records of W&B's offline ``.wandb`` file — and the resume rule
(a replayed step is not sent twice)."""

import json
import math
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from mlx_llm.errors import CheckpointError, ConfigError, InputError
from mlx_llm.train import trackers as tr
from helpers import python

CONFIG = {"model": {"d_model": 64, "n_layers": 2, "rope": None, "window": [4, 8]}, "train": {"lr": 3e-4, "bf16": True},
          "data": {"path": "/tmp/corpus", "extra": {}}}


def train_row(step: int) -> dict:
    """A train row with every kind of value: numbers, a per-layer list, a per-expert dict, and non-scalars."""
    return {"step": step, "loss": 3.0 - 0.1 * step, "grad_norm": 1.0 + step / 7, "lr": 1e-4 * step,
            "tokens": 512 * step, "layer_rms": [0.5 * step, 0.25],
            "expert": {"load": [0.6, 0.4], "imbalance": 1 / step}, "note": "warmup", "skipped": None, "clipped": True}


ROWS = [train_row(1), train_row(2), {"step": 2, "val_loss": 2.5, "val_bpb": 1.25},
        {"step": 3, "loss": float("inf"), "grad_norm": float("nan")}, train_row(4)]


def expected(rows) -> dict[str, dict[int, float]]:
    """tag -> step -> value, from the rows as metrics.jsonl holds them."""
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        for tag, value in tr.flatten_row(row).items():
            out.setdefault(tag, {})[row["step"]] = value
    return out


def same(got: float, want: float) -> bool:
    """Equal at float32 precision (TensorBoard stores float32), NaN equal to NaN."""
    return bool(np.float32(got) == np.float32(want) or (math.isnan(got) and math.isnan(want)))


# ----- TensorBoard ----------------------------------------------------------------------------------------------------
def tensorboard(run: Path):
    """TensorBoard's own reader over RUN/tb, keeping everything and purging nothing (a step written twice, in
    two event files, would then be seen twice)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(run / tr.TB_DIR), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0},
                              purge_orphaned_data=False)
    acc.Reload()
    return acc


def scalars(acc) -> dict[str, list[tuple[int, float]]]:
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_flatten_row():
    assert tr.flatten_row(train_row(2)) == {
        "loss": 2.8, "grad_norm": 1.0 + 2 / 7, "lr": 2e-4, "tokens": 1024, "layer_rms/0": 1.0, "layer_rms/1": 0.25,
        "expert/load/0": 0.6, "expert/load/1": 0.4, "expert/imbalance": 0.5}
    assert tr.flatten_row({"step": 1, "a": np.float32(0.5), "b": np.array([1, 2])}) == {"a": 0.5, "b/0": 1, "b/1": 2}
    assert tr.flatten_config(CONFIG) == {"model/d_model": 64, "model/n_layers": 2, "model/rope": "None",
                                         "model/window": "[4, 8]", "train/lr": 3e-4, "train/bf16": True,
                                         "data/path": "/tmp/corpus", "data/extra": "{}"}


def test_tensorboard_scalars_hparams_and_config(tmp_path):
    from tensorboard.plugins.hparams import plugin_data_pb2

    with tr.Trackers.open(tmp_path, ["tensorboard"], config=CONFIG, resume=False) as trackers:
        trackers.log(ROWS[:3])
        trackers.log(ROWS[3:])
    acc = tensorboard(tmp_path)
    got = scalars(acc)
    want = expected(ROWS)
    assert set(got) == set(want)  # the strings, None and bools were not sent
    for tag, by_step in want.items():
        assert [s for s, _ in got[tag]] == sorted(by_step), tag
        for step, value in got[tag]:
            assert same(value, by_step[step]), (tag, step, value, by_step[step])
    assert got["loss"][2][1] == math.inf and math.isnan(got["grad_norm"][2][1])
    assert got["val_loss"] == [(2, 2.5)] and [s for s, _ in got["loss"]] == [1, 2, 3, 4]

    text = acc.Tensors("config/text_summary")
    assert len(text) == 1 and json.loads(text[0].tensor_proto.string_val[0]) == CONFIG
    content = acc.PluginTagToContent("hparams")
    assert set(content) == {"_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info"}
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["model/d_model"].number_value == 64 and start.hparams["train/bf16"].bool_value is True
    assert start.hparams["data/path"].string_value == "/tmp/corpus"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert [m.name.tag for m in experiment.metric_infos] == list(tr.HPARAM_METRICS)
    assert json.loads((tmp_path / tr.STATE_FILE).read_text()) == {"tensorboard": {"last_step": 4}, "last_step": 4}


def test_tensorboard_resume_sends_no_step_twice(tmp_path):
    rows = [train_row(s) for s in range(1, 11)]
    with tr.Trackers.open(tmp_path, ("tensorboard",), config=CONFIG, resume=False) as trackers:
        for row in rows[:6]:
            trackers.log([row])
    # the resumed run restored the checkpoint of step 3 and replays steps 4..6 with identical values
    with tr.Trackers.open(tmp_path, ("tensorboard",), config=CONFIG, resume=True) as trackers:
        trackers.log(rows[3:5])
        trackers.log(rows[5:])
    assert len(list((tmp_path / tr.TB_DIR).glob("events.out.tfevents.*"))) == 2
    acc = tensorboard(tmp_path)
    got = scalars(acc)
    for tag, by_step in expected(rows).items():
        assert [s for s, _ in got[tag]] == list(range(1, 11)), tag  # each step once, in order
        assert all(same(v, by_step[s]) for s, v in got[tag]), tag
    assert len(acc.Tensors("config/text_summary")) == 1  # the config is written once per tracker identity
    assert json.loads((tmp_path / tr.STATE_FILE).read_text())["last_step"] == 10


def test_failed_run_bad_rows_and_bad_state(tmp_path):
    """A ``with`` block left by an exception closes the trackers without an hparams end status (the rows already
    sent stay); a row without an integer step and an unreadable state file are refused, naming what was wrong."""
    with pytest.raises(RuntimeError, match="diverged"):
        with tr.Trackers.open(tmp_path, ["tensorboard"], config=CONFIG, resume=False) as trackers:
            trackers.log([train_row(1)])
            raise RuntimeError("diverged")
    acc = tensorboard(tmp_path)
    assert "_hparams_/session_end_info" not in acc.PluginTagToContent("hparams")
    assert [s for s, _ in scalars(acc)["loss"]] == [1]
    with pytest.raises(InputError, match="closed"):
        trackers.log([train_row(2)])
    with tr.Trackers.open(tmp_path, ["tensorboard"], config=CONFIG, resume=True) as trackers:
        with pytest.raises(InputError, match=r"integer 'step': got \{'loss': 1.0\}"):
            trackers.log([{"loss": 1.0}])
    (tmp_path / tr.STATE_FILE).write_text('{"wandb": {"id": ')
    with pytest.raises(CheckpointError, match=r"trackers.json cannot be read .*delete it"):
        tr.Trackers.open(tmp_path, ["tensorboard"], config=CONFIG, resume=True)
    (tmp_path / tr.STATE_FILE).write_text('{"wandb": {}, "last_step": 3}')
    with pytest.raises(CheckpointError, match="no W&B run id"):
        tr.Trackers.open(tmp_path, ["tensorboard"], config=CONFIG, resume=True)


def test_tensorboard_reader_sees_a_duplicate(tmp_path):
    """The reader used above counts a step written twice twice, so the test above can see a duplicate."""
    from tensorboardX import SummaryWriter

    for i in range(2):
        with SummaryWriter(logdir=str(tmp_path / tr.TB_DIR), filename_suffix=f".{i}") as writer:
            writer.add_scalar("loss", 1.0, global_step=1)
    assert [s for s, _ in scalars(tensorboard(tmp_path))["loss"]] == [1, 1]


# ----- W&B (offline) --------------------------------------------------------------------------------------------------
LEVELDB_HEADER = b":W&B" + struct.pack("<H", 0xBEE1) + b"\x00"  # ident, magic, version
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """The Record protos of a ``.wandb`` file. wandb 0.31 has no Python reader (the writer is wandb-core, in Go):
    the file is a LevelDB-format log — a 7-byte header, then 32 KiB blocks of chunks, each ``crc32 (4, LE),
    length (2, LE), type (1)`` and the data, a record split over FIRST/MIDDLE/LAST chunks at block ends; the crc
    is zlib.crc32 of the data seeded with the crc of the type byte."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == LEVELDB_HEADER, data[:7]
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        if kind == 0:  # zero padding (a preallocated tail)
            pos += BLOCK - pos % BLOCK
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad chunk crc at {pos} in {path}"
        pos += 7 + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            out.append(wandb_internal_pb2.Record.FromString(pending))
    return out


def wandb_history(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> {key: value} of the history records of one offline-run directory (W&B's own ``_step``,
    ``_runtime``, ``_timestamp`` left out)."""
    (path,) = run_dir.glob("run-*.wandb")
    history: dict[int, dict[str, float]] = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            assert record.history.step.num not in history, "one history record per step"
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history


def wandb_config(run_dir: Path) -> dict:
    (path,) = run_dir.glob("run-*.wandb")
    (run,) = [r.run for r in wandb_records(path) if r.WhichOneof("record_type") == "run"]
    return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in run.config.update}


def assert_history(history: dict, rows: list[dict]) -> None:
    want = {}
    for row in rows:
        want.setdefault(row["step"], {}).update(tr.flatten_row(row))
    assert sorted(history) == sorted(want)
    for step, scalars_ in want.items():
        assert set(history[step]) == set(scalars_), step
        for key, value in scalars_.items():
            got = history[step][key]
            assert got == value or (math.isnan(got) and math.isnan(value)), (step, key, got, value)


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline and quiet, its own directories (cache, config, data) under tmp_path, not in $HOME. wandb reads
    its environment once per process (``wandb.setup``), so the test resets it before and after."""
    import wandb

    wandb.teardown()
    for var, sub in [("WANDB_DIR", "wandb_dir"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                     ("WANDB_DATA_DIR", "data")]:
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "mlx_llm_tests")
    run = tmp_path / "run"
    run.mkdir()
    yield run
    wandb.teardown()


def wandb_written() -> None:
    """Wait until wandb-core has written what it was sent: with wandb 0.31, ``run.finish()`` can return before the
    history records are in the ``.wandb`` file (seen on a loaded machine); ``wandb.teardown()`` stops wandb-core,
    which writes everything first."""
    import wandb

    wandb.teardown()


@pytest.mark.slow
def test_wandb_offline_log_and_resume(wandb_offline):
    run = wandb_offline
    rows = [train_row(s) for s in range(1, 11)] + [{"step": 6, "val_loss": 2.5, "val_bpb": float("inf")}]
    first = rows[:6] + [rows[10]]
    with tr.Trackers.open(run, ["wandb"], config=CONFIG, resume=False, name="tiny") as trackers:
        trackers.log(first[:3])
        trackers.log(first[3:6])
        trackers.log(first[6:])  # the eval row of step 6, after its train row
    wandb_written()
    run_id = json.loads((run / tr.STATE_FILE).read_text())["wandb"]["id"]
    (first_dir,) = (run / "wandb").glob(f"offline-run-*-{run_id}*")
    assert_history(wandb_history(first_dir), first)  # steps 1..6, the eval row merged into step 6
    config = wandb_config(first_dir)
    assert {k: config[k] for k in tr.flatten_config(CONFIG)} == tr.flatten_config(CONFIG)

    # resumed from the checkpoint of step 3: steps 4..6 replayed, then new ones; TensorBoard joins the run
    with tr.Trackers.open(run, ["wandb", "tensorboard"], config=CONFIG, resume=True) as trackers:
        trackers.log(rows[3:8])
        trackers.log(rows[8:10])
    wandb_written()
    dirs = set((run / "wandb").glob(f"offline-run-*-{run_id}*"))
    (second_dir,) = dirs - {first_dir}  # the same W&B run id, continued in a new offline-run directory
    assert_history(wandb_history(second_dir), rows[6:10])  # steps 7..10 only
    got = scalars(tensorboard(run))  # a tracker new to the run gets every row it is given
    assert [s for s, _ in got["loss"]] == list(range(4, 11))
    assert json.loads((run / tr.STATE_FILE).read_text()) == {
        "wandb": {"id": run_id, "last_step": 10}, "tensorboard": {"last_step": 10}, "last_step": 10}


def test_wandb_failure_to_start_is_one_line(wandb_offline, monkeypatch):
    """wandb.init refusing (here as it does online without an API key) is a one-line ConfigError saying what to do,
    and nothing is left behind."""
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ConfigError, match="WANDB_MODE=offline") as err:
        tr.Trackers.open(wandb_offline, ["wandb"], config=CONFIG, resume=False)
    assert "\n" not in str(err.value) and "--tracker wandb" in str(err.value) and "wandb login" in str(err.value)
    assert list(wandb_offline.iterdir()) == []


# ----- names and the no-op --------------------------------------------------------------------------------------------
def test_check_trackers():
    assert tr.check_trackers(()) == ()
    assert tr.check_trackers(["wandb", "tensorboard"]) == ("tensorboard", "wandb")
    assert tr.check_trackers("tensorboard, wandb") == ("tensorboard", "wandb")
    with pytest.raises(ConfigError, match=r"unknown tracker 'mlflow': valid trackers are tensorboard, wandb"):
        tr.check_trackers(("tensorboard", "mlflow"))
    with pytest.raises(ConfigError, match="'wandb' given twice"):
        tr.check_trackers(["wandb", "wandb"])


@pytest.mark.parametrize("name, package", [("wandb", "wandb"), ("tensorboard", "tensorboardX")])
def test_missing_package_is_one_line_naming_the_extra(monkeypatch, tmp_path, name, package):
    monkeypatch.setitem(sys.modules, package, None)  # find_spec and import both see it as absent
    with pytest.raises(ConfigError) as err:
        tr.check_trackers([name])
    assert str(err.value) == f"--tracker {name} needs the {package} package: pip install 'mlx_llm[track]'"
    with pytest.raises(ConfigError, match=r"mlx_llm\[track\]"):
        tr.Trackers.open(tmp_path, [name], config=CONFIG, resume=False)
    assert list(tmp_path.iterdir()) == []


def test_no_trackers_write_nothing(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with tr.Trackers.open(tmp_path, (), config=CONFIG, resume=False) as trackers:
        trackers.log(ROWS)
    trackers = tr.Trackers.open(tmp_path, [], config=CONFIG, resume=True)
    trackers.log(ROWS)
    trackers.close()
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_module_imports_no_tracker_package_nor_jax():
    code = "import sys, mlx_llm.train.trackers; print(sorted({'jax', 'wandb', 'tensorboardX'} & set(sys.modules)))"
    proc = python("-c", code, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"

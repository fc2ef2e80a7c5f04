"""Record sources for ``--data`` beside text files: JSON Lines, parquet, and datasets saved by HF ``datasets``.

A record source holds many documents, one per record: the string in the record's ``text_field`` (``--text-field``,
default ``text``). data/text.py finds the sources and splits their documents; this module only reads them.

- ``*.jsonl`` / ``*.jsonl.gz``: one JSON object per line (blank lines skipped); document ``relpath:LINE`` (LINE
  counted from 1, as editors do). Read line by line, through ``gzip`` for ``.gz``.
- ``*.parquet``: read with pyarrow in record batches of ``BATCH_ROWS`` rows of the one column (never the whole
  table); document ``relpath:ROW`` (ROW counted from 0, as pyarrow and datasets index rows).
- a directory written by ``datasets.save_to_disk``: a ``Dataset`` (``relpath:ROW``) or a ``DatasetDict``, whose
  ``train`` split is the train split and whose ``validation`` / ``val`` / ``test`` split (the first present) is the
  val split (``relpath/SPLIT:ROW``); a ``DatasetDict`` without such a split has its train split cut by name hash.
  Read through ``datasets.load_from_disk`` (memory-mapped Arrow), batch by batch.

Refusals are one-line ``DataError``s naming the file (and the line or row): an unreadable or corrupt file, a record
without the field (the fields it has are listed), a field that is not a string. pyarrow and datasets are optional
(the ``data`` extra) and imported only when such a source is read.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Iterator

from mlx_llm.errors import DataError
from mlx_llm.settings import JsonProblem, parse_json

RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
VAL_SPLIT_NAMES = ("validation", "val", "test")  # a DatasetDict's held-out split, the first one present
BATCH_ROWS = 1024  # parquet / dataset rows read at a time
_EXTRA = "pip install 'mlx_llm[data]'"


def record_kind(name: str) -> str | None:
    """``"jsonl"`` or ``"parquet"`` for a file name ending in a record suffix (any case), else ``None``."""
    low = name.lower()
    if low.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    return "parquet" if low.endswith(".parquet") else None


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``datasets.save_to_disk`` (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def _import(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise DataError(f"reading this data source needs the {module} package: {_EXTRA}") from None


def _fields(record) -> str:
    return ", ".join(map(str, record)) or "none"


def _checked(text, where: str, field: str) -> str:
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        raise DataError(f"{where}: field {field!r} is {kind}, not a string: --text-field must name a text field")
    return text


# ----- JSON Lines ----------------------------------------------------------------------------------------
def iter_jsonl(path: Path, name: str, field: str) -> Iterator[tuple[str, str]]:
    """(``name:LINE``, text) for each record of a ``.jsonl`` or ``.jsonl.gz`` file, read line by line."""
    gz = name.lower().endswith(".gz")
    try:
        with (gzip.open(path, "rb") if gz else open(path, "rb")) as fh:
            for lineno, raw in enumerate(fh, 1):
                if raw.strip():
                    yield f"{name}:{lineno}", _json_text(raw, f"{name}:{lineno}", field)
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise DataError(f"{name} is not a readable gzip file ({err or 'truncated'}): re-create it, or drop the .gz "
                        f"suffix if it is plain JSON Lines") from None
    except OSError as err:
        raise DataError(f"cannot read {name}: {err.strerror or err}") from None


def _json_text(raw: bytes, where: str, field: str) -> str:
    try:
        record = parse_json(raw.decode("utf-8"), where)
    except UnicodeDecodeError as err:
        raise DataError(f"{where} is not valid UTF-8 (byte {raw[err.start]:#04x}): JSON Lines must be UTF-8") from None
    except JsonProblem as err:
        if err.syntax is None:
            raise DataError(f"{where}: {err.detail}") from None
        raise DataError(f"{where} is not valid JSON ({err.syntax}): give one object per line") from None
    if not isinstance(record, dict):
        raise DataError(f"{where} holds a JSON {type(record).__name__}, not an object: give one object per line")
    if field not in record:
        raise DataError(f"{where} has no field {field!r} (its fields: {_fields(record)}): choose one with "
                        f"--text-field")
    return _checked(record[field], where, field)


# ----- parquet -------------------------------------------------------------------------------------------
def iter_parquet(path: Path, name: str, field: str) -> Iterator[tuple[str, str]]:
    """(``name:ROW``, text) for each row of a parquet file, ``BATCH_ROWS`` rows of one column at a time."""
    _import("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        if field not in names:
            raise DataError(f"{name} has no field {field!r} (its fields: {_fields(names)}): choose one with "
                            f"--text-field")
        kind = pf.schema_arrow.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(f"{name}: field {field!r} is {kind}, not a string: --text-field must name a text field")
        row = 0
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=[field]):
            for text in batch.column(0).to_pylist():
                yield f"{name}:{row}", _checked(text, f"{name}:{row}", field)
                row += 1
    except PermissionError as err:
        raise DataError(f"cannot read {name}: {err.strerror or 'permission denied'}") from None
    except (OSError, pa.ArrowException, ValueError) as err:  # ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise DataError(f"{name} is not a readable parquet file ({_first_line(err)})") from None


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


# ----- datasets saved with save_to_disk --------------------------------------------------------------------
def dataset_parts(path: Path) -> list[tuple[str | None, str | None]]:
    """(split name in the saved dataset or None, the corpus split it decides or None) for each part to read:
    ``[(None, None)]`` for a Dataset; for a DatasetDict its train split, and its held-out split when it has one."""
    if not (path / "dataset_dict.json").is_file():
        return [(None, None)]
    try:
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path} is not a readable saved DatasetDict ({_first_line(err)})") from None
    if "train" not in splits:
        raise DataError(f"{path} is a DatasetDict without a 'train' split (its splits: {_fields(splits)}): save the "
                        f"training records as 'train'")
    held_out = next((s for s in VAL_SPLIT_NAMES if s in splits), None)
    return [("train", None)] if held_out is None else [("train", "train"), (held_out, "val")]


def iter_dataset(path: Path, name: str, field: str, part: str | None) -> Iterator[tuple[str, str]]:
    """(``name:ROW``, text) for each row of a saved Dataset, or of split ``part`` of a saved DatasetDict."""
    _import("datasets")
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
        ds = ds[part] if part is not None else ds
    except Exception as err:  # datasets raises many kinds (FileNotFoundError, ArrowInvalid, KeyError, …)
        raise DataError(f"{name} is not a readable saved dataset ({_first_line(err)})") from None
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{name} is a {type(ds).__name__}, not a Dataset or DatasetDict saved by save_to_disk")
    if field not in ds.column_names:
        raise DataError(f"{name} has no field {field!r} (its fields: {_fields(ds.column_names)}): choose one with "
                        f"--text-field")
    dtype = getattr(ds.features[field], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise DataError(f"{name}: field {field!r} is {ds.features[field]}, not a string: --text-field must name a "
                        f"text field")
    row = 0
    for batch in ds.select_columns([field]).iter(batch_size=BATCH_ROWS):
        for text in batch[field]:
            yield f"{name}:{row}", _checked(text, f"{name}:{row}", field)
            row += 1

"""A scaling sweep's table on disk (``sweep.csv``: one row per finished point, ``COLUMNS``), written whole and
atomically each time a row is added, and read with bounded cost: every cell typed, a bad one refused in one line
naming the file, the line and the column.

A row is the proof that its point finished, so a row cut short must never count: the writer replaces the file
in one rename (a kill leaves the old table or the new one), and a table whose last line has no line end (written
by a version that appended in place, killed mid-row) is refused by ``read_table``; ``run_sweep`` drops that row
(``load_table``, saying so), and the point gets its row again from its run.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from mlx_llm.errors import DataError

COLUMNS = ("name", "budget", "budget_unit", "budget_index", "size_index", "seed", "d_model", "n_layers", "n_heads",
           "d_ff", "N", "N_total", "D", "C", "steps", "batch_size", "seq_len", "lr", "warmup_steps", "loss", "val_bpb",
           "val_ppl", "wall_seconds", "tokens_per_second", "run")
TIMING = ("wall_seconds", "tokens_per_second")  # the columns that differ between two sweeps of one spec
_INTS = ("budget_index", "size_index", "seed", "d_model", "n_layers", "n_heads", "d_ff", "N", "N_total", "D", "steps",
         "batch_size", "seq_len", "warmup_steps")
_TEXT = ("name", "budget_unit", "run")
_OPTIONAL = ("val_bpb",)  # a run without a byte count has no bits per byte
MAX_TABLE_BYTES = 64 << 20  # a sweep of 100,000 points is about 30 MB
MAX_CELL = 4096  # characters in one cell (a run's path is the longest)


def _cell(path: Path, line: int, column: str, text: str):
    """One cell typed by its column, or a ``DataError`` naming it and what is valid."""
    if column in _TEXT:
        return text
    if text in ("", "None") and column in _OPTIONAL:
        return None
    try:
        if column in _INTS:
            return int(text) if text.lstrip("-").isdigit() else _whole(float(text))
        return float(text)
    except (ValueError, OverflowError):
        kind = "an integer" if column in _INTS else "a number" + (" or empty" if column in _OPTIONAL else "")
        shown = text if len(text) <= 40 else text[:40] + "…"
        raise DataError(f"{path}:{line}: column {column} holds {shown!r}, not {kind}: the table is damaged (a "
                        f"sweep's rows are written by run_sweep)") from None


def _whole(value: float) -> int:
    if not value.is_integer():
        raise ValueError(value)
    return int(value)


def _parse(path: Path) -> tuple[list[dict], bool]:
    """(typed rows, whether the last line was cut short), bounded: the file's size, each cell's length, the
    header; every other problem is one ``DataError`` line."""
    try:
        size = path.stat().st_size
        if size > MAX_TABLE_BYTES:
            raise DataError(f"{path}: {size:,} bytes, more than the {MAX_TABLE_BYTES:,} a sweep table may have")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte offset {err.start}): the table is damaged") from None
    except OSError as err:
        raise DataError(f"{path} cannot be read ({err.strerror or err})") from None
    cut = bool(text) and not text.endswith("\n")
    if cut:
        text = text[:text.rfind("\n") + 1]  # the rows before the line cut short
    rows, reader = [], csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        if header is None:
            return [], False
        if tuple(header) != COLUMNS:
            raise DataError(f"{path}:1: the header is not a sweep table's ({', '.join(COLUMNS[:3])}, …): give "
                            f"the sweep.csv run_sweep wrote")
        for cells in reader:
            line = reader.line_num
            if len(cells) != len(COLUMNS) or any(len(c) > MAX_CELL for c in cells):
                raise DataError(f"{path}:{line}: {len(cells)} cells where a row has {len(COLUMNS)} (or a cell "
                                f"longer than {MAX_CELL:,} characters): the table is damaged")
            rows.append({k: _cell(path, line, k, c) for k, c in zip(COLUMNS, cells)})
    except csv.Error as err:
        raise DataError(f"{path}:{reader.line_num}: not a CSV table ({err})") from None
    return rows, cut


def read_table(path) -> list[dict]:
    """The rows of a sweep's CSV, typed (ints, floats, strings); [] when there is no file. A damaged table, or one
    whose last row was cut short (``run_sweep`` on its directory repairs that), raises ``DataError``."""
    path = Path(path)
    if not path.is_file():
        return []
    rows, cut = _parse(path)
    if cut:
        raise DataError(f"{path}: its last line was cut short (a sweep killed while it wrote that row): run the "
                        f"sweep on its directory again, which drops the row and reads that point again")
    return rows


def load_table(path: Path, log) -> list[dict]:
    """``read_table`` for ``run_sweep``: a last row cut short is dropped (the file rewritten without it) and
    ``log`` says so; that point then gets its row again."""
    if not path.is_file():
        return []
    rows, cut = _parse(path)
    if cut:
        write_table(path, rows)
        log(f"{path}: its last line was cut short (a kill while it was written); dropped: that point is read again")
    return rows


def write_table(path: Path, rows: list[dict]) -> None:
    """The whole table, replaced in one rename (floats written exactly, as ``repr``); a write that fails (a full
    disk) leaves the old table and no temporary file."""
    buf = io.StringIO(newline="")
    writer = csv.DictWriter(buf, fieldnames=COLUMNS)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: repr(v) if isinstance(v, float) else v for k, v in row.items()})
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(buf.getvalue(), encoding="utf-8", newline="")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def as_table(rows: list[dict]):
    """A pandas DataFrame of the rows when pandas is installed, else the list itself."""
    try:
        import pandas
    except ImportError:
        return rows
    return pandas.DataFrame(rows, columns=list(COLUMNS))


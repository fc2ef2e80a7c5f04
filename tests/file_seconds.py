"""Writes tests/file_seconds.json, the seconds each test file took in a full run, from that run's output with
``--durations=0`` (setup, call and teardown summed per file; entries under pytest's ``--durations-min`` are left
out, so small files read as 0). conftest.py hands the files to the xdist workers heaviest first, so the run does
not end with one worker alone on a long file.

    .venv/bin/python -m pytest -q -n auto --durations=0 > /tmp/run.log; .venv/bin/python tests/file_seconds.py /tmp/run.log
"""

import json
import re
import sys
from collections import Counter
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (?:setup|call|teardown)\s+(tests/[^:\s]+)::")
OUT = Path(__file__).with_name("file_seconds.json")


def per_file(lines) -> dict[str, float]:
    totals = Counter()
    for line in lines:
        if m := LINE.match(line):
            totals[Path(m.group(2)).name] += float(m.group(1))
    return {name: round(seconds, 1) for name, seconds in totals.most_common()}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/file_seconds.py PYTEST_LOG (a run with --durations=0)")
    seconds = per_file(Path(sys.argv[1]).read_text().splitlines())
    if not seconds:
        raise SystemExit(f"{sys.argv[1]} holds no --durations lines: run pytest with --durations=0")
    OUT.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"wrote {OUT}: {len(seconds)} files, {sum(seconds.values()):.0f} s")

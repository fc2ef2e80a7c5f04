"""First contact with an accelerator: one script that measures, within minutes on one GPU, what the project has
never measured on one (issue 40).

    python -m experiments.device_check                       # the full run, under 8 minutes on one H100/H200
    python -m experiments.device_check --quick               # every part at toy sizes, on whatever device is there
    python -m experiments.device_check --only attention,moe --out DIR

Parts, in this order (experiments/device_parts.py and device_attention.py; ``--only`` takes their names, and
``training`` for both training parts):
  environment     devices, memory, jax/jaxlib/CUDA versions; the same-run ``jnp.dot`` peaks: bf16, float32 at
                  the default precision (TF32 on recent NVIDIA GPUs) and float32 at "highest"
  training_124m   bf16 MFU of bench_gpu's 124M step (T = 1024, batch 32) against the bf16 peak, and the step's
  training_1b     memory as ``mlx-llm compile --target local`` predicts it against the allocator's measured peak;
                  the same for a 1.1B Llama-like model at T = 4096, batch 8, remat full
  attention       xla, flash, pallas_gpu and cuDNN (``jax.nn.dot_product_attention``) on packed documents:
                  values and gradients against the float32 reference, forward + backward at T = 1k, 4k, 16k and
                  with a sliding window of 1,024 at 4k and 16k
  moe             the MoE FFN by ragged_dot and by block dispatch against the dense SwiGLU of the same active width
  decode          tokens/s at batch 1 and 64 (the 1.1B model, bf16, context 1,024) against the bound of reading the
                  weights and K/V cache at the HBM bandwidth measured in the same process
  main_job        ``mlx-llm train`` with no flags: wall time and val bits/byte against the CPU's, the difference
                  explained when the digits differ

Isolation and time limits. Every part runs in its own child process (``python -m experiments.device_check
--part NAME``) in a process group of its own, and the parent waits at most the part's limit, then kills the
group. A cooperative deadline cannot stop a part stuck inside one XLA compile, a CUDA kernel or a hung
collective (Python runs no signal handler until the C call returns), and an in-process ``SIGALRM`` can leave the
backend in an unknown state; a killed process frees its device memory and cannot corrupt the next part. It also
isolates crashes (a segfault, an out-of-memory kill) and makes ``memory_stats()["peak_bytes_in_use"]`` one
part's own peak. The parent never imports jax: a GPU backend would claim 75 % of the device's memory for the
parent. The cost is one backend start per part (~2 s on the CPU, ~5-10 s on a GPU), counted in the estimates.
A part that raises is recorded as ``failed`` with the error; one killed at its limit as ``failed`` with
``timed_out``; one that cannot apply on this backend as ``skipped`` with the reason (so are variants inside a
part, e.g. cuDNN on the CPU). The run also has a budget (``--budget``, 470 s by default in the full run): each
part gets the smaller of its limit and what is left, and one that would get under 20 s is skipped.

Estimates for one H200 (~750 TFLOP/s bf16 dot, ~4 TB/s read; an H100 SXM is within ~15 %). Time = backend start
+ compiles + FLOPs / achieved FLOP/s or bytes / bandwidth of every call (warm-up and timed rounds):
  environment     10 s start; 3 dots of 8192² (1.1 TFLOP): bf16 ~1.5 ms, TF32 ~3 ms, fp32 ~22 ms, 16 calls
                  each, 3 compiles                                                                       ~15 s
  training_124m   10 s start, ~30 s compile; 7.2e8 FLOP/token × 32,768 tokens = 2.4e13 per step, ~70 ms at
                  45 % MFU, 12 steps                                                                     ~45 s
  training_1b     10 s start, ~45 s compile, ~5 s init (17.7 GB of fp32 weights + AdamW); 7.9e9 FLOP/token ×
                  32,768 = 2.6e14 per step (+1/3 recomputed), ~0.9 s at ~300 TFLOP/s, 7 steps; ~30 GB   ~70 s
  attention       10 s start; 28 compiled forward+backward programs, ~1.2 s each; per call 0.24 / 0.96 / 3.85
                  TFLOP at T = 1k / 4k / 16k (B·T = 16,384, H = 16, G = 4, K = 128): cuDNN and Triton 1-15
                  ms; the xla reference at 16k moves ~100 GB of scores (~25 ms, needs ~52 GB, skipped when
                  that passes 90 % of the device); pure-JAX flash runs 8,256 sequential tiles each way at 16k
                  (~50 µs each: ~0.8 s per call), 4 calls per variant                                    ~60 s
  moe             10 s start, 3 compiles ~5 s; 2.5 TFLOP active per call (16,384 tokens, d = 2048, X = 16,
                  k = 2, m = 2048): dense ~4 ms, block ~8 ms, ragged_dot ≤ 40 ms, 6 calls each          ~30 s
  decode          10 s start, 4 compiles (prefill, decode scan; batch 1 and 64) ~15 s each; 4 GiB read ~1 ms;
                  batch 1: 2.2 GB of weights per step, ~0.55 ms × 128 steps; batch 64: prefill 1.4e14 FLOP
                  ~0.3 s + (2.2 GB weights + 2.1 GB cache) per step, ~1.1 ms × 128; 4 calls each        ~75 s
  main_job        10 s start; BPE training + encoding of 12 MB on the host (~25 s on 2 cores); ~20 s of
                  compiles; 700 steps of a 0.87M model, launch-bound, ~4 ms each; 8 checkpoints, eval of
                  148k tokens, a 200-token sample                                                        ~60 s
  total ≈ 355 s (6 min); limits 60 / 120 / 150 / 150 / 90 / 150 / 180 s under the 470 s budget.

Results: experiments/results/device_<kind>.json (``--out DIR``: DIR/…; under --quick ``_quick`` is added and the
default directory is a temporary one, so results/ only holds device runs), kind from the device
(``device_nvidia_h200.json``, ``device_cpu_quick.json``), written after every part (a run cut
short keeps what it measured) with ``common.save_result``'s provenance (the devices as the children saw them),
then a short table. Each part's record: status (ok / failed / skipped), reason, seconds, limit, the one-line
summary and its result; a failed part also keeps the last lines of its output. The docs' measurements page
fills its "Accelerator (device check)" table from this file: ``--markdown FILE`` prints it (docs/accelerator.md).

Flags are checked before anything runs or is written: ``--only`` naming no part or an unknown one, a ``--budget``
that is not a positive number of seconds, a ``--time-limit`` that is not PART=SECONDS with SECONDS > 0, an ``--out``
that cannot be made a writable directory, or a ``--markdown`` file that is not a results file of this script is
refused in one line (``device_check: error: ...``), exit status 2. Ctrl-C (SIGINT) kills the running part's process
group, writes the results so far with ``"complete": false`` and ``"interrupted"`` saying where, the part cut short
recorded as failed, and exits 130.

Test hook: ``MLX_LLM_DEVICE_CHECK_FAULT="PART:MODE,..."`` makes a child fail on purpose before it imports jax,
MODE = raise (an exception), crash (exit 3 without a result), hang (sleep until killed) or skip.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from experiments import common

PARTS = ("environment", "training_124m", "training_1b", "attention", "moe", "decode", "main_job")
GROUPS = {"training": ("training_124m", "training_1b")}
LIMITS = {"environment": 60, "training_124m": 120, "training_1b": 150, "attention": 150, "moe": 90, "decode": 150,
          "main_job": 180}  # seconds, full run
ESTIMATES = {"environment": 15, "training_124m": 45, "training_1b": 70, "attention": 60, "moe": 30, "decode": 75,
             "main_job": 60}  # seconds on one H200 (the docstring says how)
QUICK_LIMIT = 600  # any part at toy sizes, on a slow shared CPU
BUDGET = 470.0  # the full run's seconds: under 8 minutes, with the parent's own few seconds
MIN_START = 20.0  # a part is not started with less time than this left in the budget
FAULT_ENV = "MLX_LLM_DEVICE_CHECK_FAULT"
TAIL_LINES = 30
INTERRUPTED = 130  # the exit status of a run stopped by SIGINT (128 + 2, as a shell reports it)


class BadFlag(SystemExit):
    """A flag refused before anything runs: ``main`` prints it as one line and exits with status 2 (argparse's
    status for a usage error); the message is ``str()`` of it."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="every part at toy sizes (the test suite's run)")
    ap.add_argument("--only", help=f"comma-separated parts (default all): {', '.join(PARTS)}; 'training' for both")
    ap.add_argument("--out", type=Path, help="directory of device_<kind>.json (default experiments/results; under "
                    "--quick a directory in the system's temporary directory)")
    ap.add_argument("--budget", type=float, help=f"seconds for the whole run (default {BUDGET:g}; none under --quick)")
    ap.add_argument("--time-limit", action="append", default=[], metavar="PART=SECONDS",
                    help="a part's own limit instead of its default (repeatable)")
    ap.add_argument("--markdown", type=Path, metavar="FILE",
                    help="print a results file as the docs' Accelerator (device check) table, and run nothing")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # the child: run this part here
    ap.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)  # where the child writes its record
    ap.add_argument("--earlier", type=Path, help=argparse.SUPPRESS)  # results of the parts before it
    return ap.parse_args(argv)


def selected(only: str | None) -> list[str]:
    if only is None:
        return list(PARTS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    if not names:
        raise BadFlag(f"--only {only!r} names no part: give one or more of {list(PARTS)} or {list(GROUPS)}, "
                      f"comma-separated")
    unknown = [n for n in names if n not in PARTS and n not in GROUPS]
    if unknown:
        raise BadFlag(f"--only: unknown part(s) {unknown}: valid parts are {list(PARTS)} and {list(GROUPS)}")
    wanted = {p for n in names for p in GROUPS.get(n, (n,))}
    return [p for p in PARTS if p in wanted]


def limits(args) -> dict:
    out = {p: QUICK_LIMIT if args.quick else LIMITS[p] for p in PARTS}
    for item in args.time_limit:
        name, _, seconds = item.partition("=")
        if name not in PARTS or not re.fullmatch(r"\d+(\.\d+)?", seconds) or float(seconds) <= 0:
            raise BadFlag(f"--time-limit {item!r}: give PART=SECONDS with PART one of {list(PARTS)} and SECONDS > 0")
        out[name] = float(seconds)
    return out


def unwritable(directory: Path) -> str | None:
    """Why ``directory`` cannot be made a writable directory, or None; creates nothing (the nearest existing
    ancestor must be a directory this process may write into)."""
    probe = directory.absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def checked(args) -> tuple[list[str], dict]:
    """The parts to run and their limits, after every flag of a run is checked (``BadFlag`` otherwise); fills in
    the defaults of ``--out`` and ``--budget``. Nothing is written."""
    parts, part_limits = selected(args.only), limits(args)
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget > 0):
        raise BadFlag(f"--budget {args.budget:g}: give the run's seconds, a positive number (default {BUDGET:g})")
    args.out = args.out or (Path(tempfile.gettempdir()) / "mlx_llm_device_check" if args.quick else common.RESULTS)
    why = unwritable(args.out)
    if why:
        raise BadFlag(f"--out {args.out}: cannot write the results there: {why}")
    args.budget = args.budget if args.budget is not None else (None if args.quick else BUDGET)
    return parts, part_limits


def read_results(path: Path) -> dict:
    """A results file for ``--markdown``, or ``BadFlag`` saying why it is not one (its table is built here, so a
    file with missing fields is refused rather than half printed)."""
    try:
        data = json.loads(path.read_text())
        markdown(data)
    except OSError as exc:
        raise BadFlag(f"--markdown {path}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise BadFlag(f"--markdown {path}: not JSON: {exc}") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise BadFlag(f"--markdown {path}: not a device check results file ({type(exc).__name__}: {exc})") from None
    return data


# ----- the child ----------------------------------------------------------------------------------------------
def fault(part: str) -> None:
    """The test hook: fail on purpose as ``FAULT_ENV`` asks for this part (before jax is imported)."""
    modes = dict(item.split(":", 1) for item in os.environ.get(FAULT_ENV, "").split(",") if ":" in item)
    mode = modes.get(part)
    if mode == "raise":
        raise RuntimeError(f"fault injected into {part} ({FAULT_ENV})")
    if mode == "crash":
        os._exit(3)
    if mode == "hang":
        time.sleep(10**6)
    if mode == "skip":
        raise SkipPart(f"fault injected into {part} ({FAULT_ENV})")


class SkipPart(Exception):
    pass


def die_with_parent() -> None:
    """Linux: this child is killed when the parent dies (``PR_SET_PDEATHSIG``), so a parent killed at the end of a
    device window leaves no orphan holding the GPU; elsewhere nothing."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def run_child(args) -> int:
    """Run one part in this process and write its record to ``--part-out``."""
    die_with_parent()
    record = {"status": "ok", "reason": None, "result": None, "devices": None}
    try:
        fault(args.part)
        from experiments import device_attention, device_parts

        parts = {**{p: getattr(device_parts, p) for p in PARTS if p != "attention"},
                 "attention": device_attention.attention_part}
        earlier = json.loads(args.earlier.read_text()) if args.earlier else {}
        try:
            record["result"] = parts[args.part](args.quick, earlier)
        except device_parts.Skip as exc:
            record.update(status="skipped", reason=str(exc))
    except SkipPart as exc:
        record.update(status="skipped", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 (the record says what failed; the parent runs the next part)
        traceback.print_exc()
        record.update(status="failed", reason=f"{type(exc).__name__}: {exc}"[:2000])
    if "jax" in sys.modules:
        record["devices"] = common.devices()
    args.part_out.write_text(json.dumps(record, default=common.jsonable))
    return 0 if record["status"] != "failed" else 1


# ----- the parent ---------------------------------------------------------------------------------------------
def _pump(stream, part: str, tail: collections.deque) -> None:
    for line in stream:
        tail.append(line.rstrip("\n"))
        print(f"[{part}] {line}", end="", flush=True)


def run_part(part: str, args, earlier: dict, limit: float, work: Path) -> dict:
    """Run ``part`` in a child process group, killed after ``limit`` seconds; its record (never raises)."""
    out, given = work / f"{part}.json", work / "earlier.json"
    given.write_text(json.dumps(earlier, default=common.jsonable))
    command = [sys.executable, "-m", "experiments.device_check", "--part", part, "--part-out", str(out),
               "--earlier", str(given)] + (["--quick"] if args.quick else [])
    tail = collections.deque(maxlen=TAIL_LINES)
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=common.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    pump = threading.Thread(target=_pump, args=(proc.stdout, part, tail), daemon=True)
    pump.start()
    try:
        code, timed_out = proc.wait(timeout=limit), False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it may have ended in between
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own group: it and whatever it started
        code, timed_out = proc.wait(), True
    except KeyboardInterrupt:  # the child is in a session of its own, so Ctrl-C reached only the parent
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    pump.join(timeout=10)
    record = {"status": "failed", "reason": None, "result": None, "devices": None}
    if not timed_out and out.exists():
        record = json.loads(out.read_text())
    elif timed_out:
        record["reason"], record["timed_out"] = f"timed out: killed after its limit of {limit:.0f} s", True
    else:
        record["reason"] = f"the child process ended with exit code {code} and wrote no result"
    record.update(seconds=time.perf_counter() - start, limit_seconds=limit)
    if record["status"] == "failed":
        record["output_tail"] = list(tail)
    return record


def kind_name(devices: dict | None, quick: bool) -> str:
    kind = re.sub(r"[^a-z0-9]+", "_", (devices or {}).get("kind", "unknown").lower()).strip("_") or "unknown"
    return f"device_{kind}" + ("_quick" if quick else "")


def summary_line(record: dict) -> str:
    """The table's text of a part: its summary, or the first line of why it failed or was skipped."""
    if record["status"] == "ok":
        return (record["result"] or {}).get("summary", "")
    return (record.get("reason") or "").strip().split("\n")[0]


def table(records: dict) -> str:
    rows = [f"{'part':<14} {'status':<8} {'seconds':>8}  summary"]
    for part, r in records.items():
        rows.append(f"{part:<14} {r['status']:<8} {r['seconds']:>8.1f}  {summary_line(r)}")
    return "\n".join(rows)


def markdown(data: dict) -> str:
    """A results file as the docs' "Accelerator (device check)" table: where it ran, then a row per part."""
    prov, est = data["provenance"], data.get("estimate_seconds") or {}
    dev = prov["devices"]
    machine = f"{dev['count']}× {dev['kind']} ({dev['platform']})" if dev["platform"] else "no device reached"
    where = (f"{machine}, jax {prov['versions'].get('jax')}, "
             f"{prov['date'][:10]}, commit {(prov['commit'] or '?')[:10]}{', quick' if data['quick'] else ''}")
    rows = [where, "", "| part | status | seconds | estimate | result |", "|---|---|---:|---:|---|"]
    for part in data["order"]:
        r = data["parts"][part]
        rows.append(f"| {part} | {r['status']} | {r['seconds']:.0f} | {est.get(part, '')} | "
                    f"{summary_line(r).replace('|', '/')} |")
    return "\n".join(rows)


NO_DEVICES = {"platform": None, "kind": "unknown", "count": None}  # no child reached a backend


def save(records: dict, args, devices: dict | None, complete: bool, interrupted: str | None = None) -> Path:
    """Write the results so far; the devices are the children's (the parent never starts a backend).
    ``interrupted`` says where a run stopped by SIGINT stopped (null otherwise)."""
    devices = devices or NO_DEVICES
    payload = {"quick": args.quick, "complete": complete, "interrupted": interrupted, "parts": records,
               "order": list(records),
               "budget_seconds": args.budget, "estimate_seconds": None if args.quick else ESTIMATES,
               "table": table(records).splitlines()}
    return common.save_result(kind_name(devices, args.quick), payload, args.out, device_info=devices)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part:
        return run_child(args)
    try:
        if args.markdown:
            print(markdown(read_results(args.markdown)))
            return 0
        parts, part_limits = checked(args)
    except BadFlag as exc:
        print(f"device_check: error: {exc}", file=sys.stderr)
        return 2
    print("$ " + common.command_line(), flush=True)
    records, progress = {}, {"part": None, "start": time.perf_counter(), "devices": None}
    try:
        run_parts(parts, part_limits, args, records, progress)
    except KeyboardInterrupt:
        return interrupted(records, progress, args)
    path = save(records, args, progress["devices"], complete=True)
    print("\n" + table(records))
    print(f"wrote {path}")
    return 1 if any(r["status"] == "failed" for r in records.values()) else 0


def run_parts(parts: list[str], part_limits: dict, args, records: dict, progress: dict) -> None:
    """Run the parts in order under the budget, each record into ``records`` and the file rewritten after each;
    ``progress`` says which part is running since when, and the devices the children saw."""
    earlier, start = {}, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="device_check_") as tmp:
        for part in parts:
            left = None if args.budget is None else args.budget - (time.perf_counter() - start)
            if left is not None and left < MIN_START:
                records[part] = {"status": "skipped", "reason": f"the run's budget of {args.budget:.0f} s was spent",
                                 "result": None, "seconds": 0.0, "limit_seconds": 0.0}
                continue
            limit = part_limits[part] if left is None else min(part_limits[part], left)
            print(f"== {part} (limit {limit:.0f} s)", flush=True)
            progress.update(part=part, start=time.perf_counter(), limit=limit)
            records[part] = record = run_part(part, args, earlier, limit, Path(tmp))
            progress["part"] = None
            progress["devices"] = progress["devices"] or record.get("devices")
            if record["status"] == "ok":
                earlier[part] = record["result"]
            print(f"== {part}: {record['status']} in {record['seconds']:.1f} s  {summary_line(record)}", flush=True)
            if progress["devices"]:  # the file's name needs the device kind, which only a child knows
                save(records, args, progress["devices"], complete=False)


def interrupted(records: dict, progress: dict, args) -> int:
    """After SIGINT: the part cut short recorded as failed, the results so far written as incomplete; 130."""
    part, where = progress["part"], "between parts"
    if part is not None:
        seconds = time.perf_counter() - progress["start"]
        records[part] = {"status": "failed", "reason": f"interrupted (SIGINT) after {seconds:.0f} s",
                         "interrupted": True, "result": None, "devices": None, "seconds": seconds,
                         "limit_seconds": progress["limit"]}
        where = f"during {part}"
    path = save(records, args, progress["devices"], complete=False, interrupted=f"SIGINT {where}")
    print(f"device_check: interrupted (SIGINT) {where}; wrote the results so far, marked incomplete, to {path}",
          file=sys.stderr)
    return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

"""Build tests/data/arithmetic_sft: the preference tests' fixed starting checkpoint (see its README.md).

    python tests/build_sft_start.py

The tiny base (``tiny_runs.pretrain``) fully fine-tuned on arithmetic for 4,000 steps (``tiny_runs.sft_arithmetic``),
in the suite's numerics (float64 enabled, conftest.py's XLA flags). Training this far is chaotic in float rounding
(the same recipe without float64 ends at another exact match), so the tests start from this one committed draw
instead of rebuilding it; the base's absolute path in run.json is replaced by ``BASE_PLACEHOLDER``.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import conftest  # noqa: E402,F401  (float64 and the suite's XLA flags, before any computation)

from tiny_runs import pretrain, sft_arithmetic  # noqa: E402

OUT = HERE / "data" / "arithmetic_sft"
BASE_PLACEHOLDER = "/tmp/mlx_llm_sft_start_base"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sft = sft_arithmetic(root, pretrain(root))
        record = json.loads((sft / "run.json").read_text())
        record["base"]["run"] = BASE_PLACEHOLDER
        (sft / "run.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        for name in ("loss.png", "run.lock", "sample.txt"):
            (sft / name).unlink(missing_ok=True)
        shutil.rmtree(OUT, ignore_errors=True)
        shutil.copytree(sft, OUT)
    summary = json.loads((OUT / "summary.json").read_text())
    print(f"{OUT}: held-out exact match {summary['heldout_accuracy']:.4f} (base {summary['base_heldout_accuracy']}), "
          f"val loss {summary.get('val_loss')}; XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")


if __name__ == "__main__":
    main()

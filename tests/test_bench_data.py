"""experiments/bench_data.py in its ``--quick`` form: both encoding paths measured in fresh processes, the result
file holding their speed and peak RSS, and the streaming path's tokens equal to the all-in-memory baseline's."""

import json

import pytest

from experiments import bench_data


@pytest.mark.slow
def test_quick_bench_reports_both_paths_with_equal_tokens(tmp_path):
    assert bench_data.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_data.json").read_text())
    assert [r["size_mb"] for r in result["rows"]] == [2, 4] and "provenance" in result
    for row in result["rows"]:
        for path in ("stream", "baseline"):
            m = row[path]
            assert {"seconds", "n_bytes", "n_tokens", "mb_per_s", "mtokens_per_s", "peak_rss_mb",
                    "worker_peak_rss_mb", "tokens_sha256"} <= set(m)
            assert m["peak_rss_mb"] > 0 and m["mb_per_s"] > 0 and m["n_tokens"] > m["n_bytes"] * 0.9
        assert row["tokens_equal"] and row["stream"]["tokens_sha256"] == row["baseline"]["tokens_sha256"]
        assert row["stream"]["n_tokens"] == row["baseline"]["n_tokens"]
        assert row["rss_ratio_baseline_over_stream"] > 0
    assert result["tokens_equal"] and set(result["peak_rss_growth"]) == {"stream", "baseline"}

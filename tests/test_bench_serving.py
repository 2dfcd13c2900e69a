"""The serving benchmark runs (``--quick``: a tiny GPT) and prints its four figures: decode against
batch size with its place on the roofline, continuous against static batching, TP 2 decode against
one rank (its bytes equal to the closed form), KV memory with blocks against a reserved maximum.
Speed itself is not checked here."""
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_serving.py"


def test_bench_serving_quick_prints_the_four_figures(tmp_path):
    out = tmp_path / "serving.json"
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    for heading in ("(a) decode against batch size", "(b) continuous against static", "(c) TP 2 decode",
                    "(d) KV memory"):
        assert heading in result.stdout
    assert "NOT equal" not in result.stdout
    figures = json.loads(out.read_text())
    rows = figures["decode"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2, 4] and all(r["memory_bound"] for r in rows)
    assert rows[1]["flop_per_byte"] > rows[0]["flop_per_byte"]  # intensity grows with the batch
    stream = figures["stream"]
    # the same requests and tokens; continuous batching needs fewer steps (requests join at once)
    assert stream["static"]["tokens"] == stream["continuous"]["tokens"]
    assert stream["continuous"]["steps"] < stream["static"]["steps"]
    tp = figures["tp"]
    assert tp["kv_bytes_per_rank_over_one"] == 0.5
    assert all(r["bytes_sent"] == tp["closed_form_bytes_per_rank"] for r in tp["tp_2"])
    kv = figures["kv_memory"]
    assert kv["stored_positions_peak_bytes"] <= kv["paged_peak_bytes"] < kv["reserved_maximum_bytes"]

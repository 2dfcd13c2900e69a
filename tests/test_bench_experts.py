"""The experts benchmark runs (``--quick``) and prints its five figures; its JSON holds them. Speed is
not checked; the counts are: no bytes on one rank, bytes on more; drops fall as the capacity grows and
vanish at the largest factor here; the MoE's active parameters are the dense model's plus its routers."""
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_experts.py"


def test_bench_experts_quick_prints_its_figures(tmp_path):
    out = tmp_path / "experts.json"
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for heading in ("(a) load over training", "(b) drop rate against capacity factor", "(c) one MoE layer",
                    "(d) roofline", "(e) Shakespeare"):
        assert heading in result.stdout
    figures = json.loads(out.read_text())
    assert set(figures["balance"]) == {"none", "aux_loss", "bias"}
    for row in figures["balance"].values():
        rates = list(row["drop_rate"].values())
        assert rates == sorted(rates, reverse=True) and rates[-1] == 0.0 and rates[0] > 0
        assert all(sum(load) == 4 * 16 * 2 for load in row["tokens_per_expert"])  # B·T·k assignments a step
    ep = figures["ep"]
    assert ep[0]["ranks"] == 1 and ep[0]["bytes_per_rank_per_step"] == 0
    assert all(row["bytes_per_rank_per_step"] > 0 for row in ep[1:])
    dense, moe = figures["moe_vs_dense"].values()
    layers, width, experts = 1, 16, 4
    assert moe["active_parameters"] - dense["active_parameters"] == layers * experts * width  # the routers
    assert figures["roofline"]["ridge_flop_per_byte"] > 0

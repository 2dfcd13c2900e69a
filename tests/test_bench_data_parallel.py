"""Smoke test: the data-parallel benchmark launches its runs (single process and mpiexec
-n 1, 2, 4), prints its tables and writes sane JSON. Speed is not judged here (the
machine is shared); the byte counts are, since they do not depend on the machine."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_data_parallel.py"


@pytest.mark.mpi
def test_bench_data_parallel_quick(tmp_path):
    beside = Path(sys.executable).parent / "mpiexec"
    if not beside.exists() and shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not found next to the Python interpreter or on PATH")
    out = tmp_path / "bench.json"
    try:
        done = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"benchmark --quick took more than 60 s:\n{e.stdout}\n{e.stderr}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "samples/s" in done.stdout and "vs single" in done.stdout and "ddp 2 vs single" in done.stdout
    assert "ddp 2 / indep 2: " in done.stdout and "ddp 1 / single: " in done.stdout  # the paired verdicts

    report = json.loads(out.read_text())
    rows = {r["config"]: r for r in report["rows"]}
    assert list(rows) == ["single", "indep 2", "ddp 1", "ddp 2", "ddp 4", "blocking 2"]
    assert rows["single"]["speedup"] == 1.0
    n_bytes = report["parameter_bytes"]
    for name, p in (("ddp 2", 2), ("ddp 4", 4), ("blocking 2", 2)):
        row = rows[name]
        assert row["global_batch"] == p * report["batch"] and row["samples_per_s"] > 0
        assert 0 <= row["comm_fraction"] <= 1 and 0 < row["compute_fraction"] <= 1
        # the ring's bytes per rank per step, within chunk rounding (2 chunks per bucket)
        assert abs(row["bytes_sent_per_step"] - 2 * (p - 1) / p * n_bytes) <= 2 * 4 * row["buckets"]
        # one step's lanes per rank: compute before the end of the step, one comm interval per bucket
        assert len(row["timeline"]) == p and 0 <= row["hidden_fraction"] <= 1
        for lanes in row["timeline"]:
            assert len(lanes["comm"]) == row["buckets"]
            assert all(0 <= a <= b <= lanes["end"] for a, b in lanes["compute"])
    assert rows["blocking 2"]["buckets"] == rows["ddp 2"]["buckets"] >= 2  # 1 MiB first bucket, then the rest
    for name, (contender, reference) in (("ddp 2 / indep 2", ("ddp 2", "indep 2")),
                                         ("ddp 1 / single", ("ddp 1", "single"))):
        runs = zip(rows[contender]["samples_per_s_runs"], rows[reference]["samples_per_s_runs"])
        assert report["paired"][name]["rounds"] == pytest.approx([a / b for a, b in runs])  # within each round
    slow = report["slow_link"]
    assert slow["buckets"] == 16 and slow["exchange_s"] > 0 and slow["exposed_with_overlap_s"] >= 0
    for entry in report["traffic"]:
        m = entry["workers"]
        assert abs(entry["all_reduce_in_out"] - 4 * (m - 1) / m * n_bytes) <= 4 * 4
        if entry["ps_one_server"] is not None:  # measured with the parameter-server module
            assert entry["ps_one_server"] == pytest.approx(2 * n_bytes * m)
            assert entry["ps_two_servers"] == pytest.approx(n_bytes * m, rel=1e-3)


def test_each_contender_runs_beside_its_reference_and_ratios_pair_rounds():
    """The targets' ratios are taken within a round (both under the same load from elsewhere),
    then their median: not the ratio of two medians from different rounds."""
    sys.path.insert(0, str(BENCH.parent))
    import bench_data_parallel as bench

    configs = [None, ("indep", 2), 1, 2, 4, ("blocking", 2)]
    assert bench.launch_order(configs) == [None, 1, ("indep", 2), 2, 4, ("blocking", 2)]
    assert bench.launch_order([None, 1, 4]) == [None, 1, 4]
    # round 1 slowed ddp 1 down, round 2 single: the ratio of medians would say 60 / 100
    runs = {None: [{"samples_per_s": s} for s in (100, 60, 100)], 1: [{"samples_per_s": s} for s in (60, 59, 99)],
            ("indep", 2): [{"samples_per_s": 200}] * 3, 2: [{"samples_per_s": s} for s in (190, 150, 210)]}
    paired = bench.paired_ratios(runs)
    assert paired["ddp 1 / single"]["rounds"] == pytest.approx([0.6, 59 / 60, 0.99])
    assert paired["ddp 1 / single"]["median"] == pytest.approx(59 / 60)
    assert paired["ddp 2 / indep 2"]["median"] == pytest.approx(0.95)
    assert "ddp 2 / indep 2" not in bench.paired_ratios({**runs, ("indep", 2): []})

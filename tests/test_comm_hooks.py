"""DDP communication hooks (minidist.parallel.data_parallel.comm_hooks): each hook's average against the fp32
average computed with NumPy, within its format's bound; the bytes they send against the
formulas; error feedback's bookkeeping; registration errors; training with each hook on the sim
and with fp16 under mpiexec."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from mpitools import mpiexec_or_skip

from minidist import backend, cli, data, nn, sim, train
from minidist.functions import cross_entropy
from minidist.parallel.data_parallel import DistributedDataParallel
from minidist.parallel.data_parallel import comm_hooks as ch
from minidist.parallel.data_parallel.train import train_ddp
from minidist.tensor import Tensor
from minidist.tracing import CountingComm

ROOT = Path(__file__).resolve().parents[1]
N = 1001  # an odd bucket size: uneven ring chunks


def local_gradients(p, n=N, seed=0):
    """p float32 vectors of different magnitudes (rank r's local gradient)."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * (1 + r)).astype(np.float32) for r in range(p)]


def run_hook(p, hook, state_factory=lambda: None, steps=1, seed=0):
    """Every rank runs the hook on its gradient for ``steps`` steps (new gradients each step).
    Returns (per rank: list of averaged results, the state, bytes sent)."""
    grads = [local_gradients(p, seed=seed + t) for t in range(steps)]

    def rank_main(comm):
        counting = CountingComm(comm, keep_messages=False)
        state, results = state_factory(), []
        for t in range(steps):
            bucket = ch.GradBucket(0, grads[t][comm.Get_rank()].copy(), [], [0], True, counting, "ring")
            results.append(hook(state, bucket).wait())
        return results, state, counting.nbytes

    return sim.run(rank_main, p), grads


def assert_identical_on_every_rank(outs):
    for r, out in enumerate(outs[1:], 1):
        assert np.array_equal(out, outs[0]), f"rank {r} got other bytes than rank 0"


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("hook, wire, eps", [(ch.fp16_compress_hook, np.float16, 2.0**-11),
                                             (ch.bf16_compress_hook, ml_dtypes.bfloat16, 2.0**-8)],
                         ids=["fp16", "bf16"])
def test_half_precision_average_matches_fp32_within_its_rounding(p, hook, wire, eps):
    (results), grads = run_hook(p, hook)
    outs = [r[0][0] for r in results]
    assert_identical_on_every_rank(outs)
    got, exact = outs[0], np.mean(np.stack(grads[0]).astype(np.float64), axis=0)
    assert got.dtype == np.float32 and got.shape == (N,)
    # p rounded inputs, p-1 rounded additions: each error at most eps times the magnitudes summed
    bound = (p + 2) * eps * np.mean(np.abs(np.stack(grads[0])), axis=0)
    assert np.all(np.abs(got - exact) <= bound)
    assert np.array_equal(got.astype(wire).astype(np.float32), got)  # it went through the wire format
    assert not np.array_equal(got, np.mean(np.stack(grads[0]), axis=0))  # ... so it is not the fp32 average


@pytest.mark.parametrize("p", [2, 3, 4])
def test_int8_average_is_within_half_a_step_per_rank(p):
    results, grads = run_hook(p, ch.int8_compress_hook)
    outs = [r[0][0] for r in results]
    assert_identical_on_every_rank(outs)
    stack = np.stack(grads[0]).astype(np.float64)
    half_steps = np.mean(np.abs(stack).max(axis=1) / 127) / 2  # mean over ranks of s_r / 2
    error = np.abs(outs[0] - stack.mean(axis=0))
    assert error.max() <= half_steps * (1 + 1e-5)
    assert error.max() > half_steps / 10  # the quantisation shows: this is not the fp32 average


@pytest.mark.parametrize("p", [2, 3])
def test_topk_without_error_feedback_averages_each_rank_s_largest_entries(p):
    ratio = 0.05
    results, grads = run_hook(p, ch.topk_compress_hook, lambda: ch.TopKState(ratio, error_feedback=False))
    outs = [r[0][0] for r in results]
    assert_identical_on_every_rank(outs)
    k = math.ceil(ratio * N)
    expected = np.zeros(N)
    for g in grads[0]:  # the oracle: a full sort by magnitude
        keep = np.argsort(-np.abs(g), kind="stable")[:k]
        expected[keep] += g[keep]
    np.testing.assert_allclose(outs[0], expected / p, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make_state, hook", [(lambda: ch.TopKState(0.02), ch.topk_compress_hook),
                                              (ch.ErrorFeedbackState, ch.int8_compress_hook)],
                         ids=["topk", "int8"])
def test_error_feedback_loses_nothing_over_steps(make_state, hook):
    """Stich et al. 2018: the applied updates plus the mean residual add up to the true sums."""
    p, steps = 3, 6
    results, grads = run_hook(p, hook, make_state, steps=steps)
    applied = np.sum([np.asarray(a, np.float64) for a in results[0][0]], axis=0)
    residual = np.mean([r[1].residuals[0] for r in results], axis=0)
    truth = np.sum([np.mean(np.stack(g).astype(np.float64), axis=0) for g in grads], axis=0)
    np.testing.assert_allclose(applied + residual, truth, rtol=1e-5, atol=1e-5)
    assert np.abs(residual).max() > 1e-3  # something was held back


# -- inside DistributedDataParallel: gradients and bytes ------------------------------------------

SIZES = [12, 40, 30, 4]


def ddp_step(p, name, algorithm="ring", bucket_cap_mb=2000 / 2**20):
    """One DDP step with hook ``name`` on p sim ranks. Returns (rank 0's gradients, bytes sent
    by rank 0, the buckets' sizes)."""
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((8, SIZES[0])).astype(np.float32) for _ in range(p)]
    ys = [rng.integers(0, SIZES[-1], 8) for _ in range(p)]

    def rank_main(comm):
        ddp = DistributedDataParallel(nn.mlp(SIZES, rng=1), comm, bucket_cap_mb=bucket_cap_mb, algorithm=algorithm)
        if name != "none":
            ddp.register_comm_hook(*ch.comm_hook(name, 0.1))
        r = comm.Get_rank()
        cross_entropy(ddp(Tensor(xs[r])), ys[r]).backward()
        return [q.grad.copy() for q in ddp.parameters()], ddp.stats.bytes_sent, [b.numel for b in ddp.buckets]

    results = sim.run(rank_main, p)
    local = []  # the oracle: each rank's gradient in one plain process, averaged with NumPy
    for r in range(p):
        model = nn.mlp(SIZES, rng=1)
        cross_entropy(model(Tensor(xs[r])), ys[r]).backward()
        local.append([q.grad.astype(np.float64) for q in model.parameters()])
    mean = [np.mean(g, axis=0) for g in zip(*local)]
    return results[0], mean


@pytest.mark.parametrize("algorithm", ["ring", "auto"])
def test_ddp_fp16_and_bf16_send_exactly_half_the_bytes(algorithm):
    p = 3
    (_, full, numels), _ = ddp_step(p, "none", algorithm)
    assert len(numels) >= 2 and full > 0
    for name in ("fp16", "bf16"):
        (_, half, _), _ = ddp_step(p, name, algorithm)
        assert half * 2 == full, name


@pytest.mark.parametrize("name, tol", [("none", 1e-6), ("fp16", 2e-3), ("bf16", 2e-2), ("int8", 3e-2),
                                       ("topk", None)])
def test_ddp_with_each_hook_averages_the_ranks_gradients(name, tol):
    p = 3
    (grads, nbytes, numels), mean = ddp_step(p, name)
    if name == "int8":
        assert nbytes == sum((p - 1) * (n + 4) for n in numels)  # one int8 per element + a float32 scale
    if name == "topk":
        assert nbytes == sum((p - 1) * math.ceil(0.1 * n) * 8 for n in numels)  # int32 index + float32 value
        return
    for g, m in zip(grads, mean):
        assert g.dtype == np.float32
        assert np.abs(g - m).max() <= tol * np.abs(m).max()


def test_register_comm_hook_errors():
    def rank_main(comm):
        found = []
        ddp = DistributedDataParallel(nn.mlp([4, 3], rng=0), comm)
        with pytest.raises(TypeError, match="callable"):
            ddp.register_comm_hook(None, "fp16")
        ddp.register_comm_hook(None, ch.fp16_compress_hook)
        with pytest.raises(RuntimeError, match="only be called once"):
            ddp.register_comm_hook(None, ch.fp16_compress_hook)
        late = DistributedDataParallel(nn.mlp([4, 3], rng=0), comm)
        cross_entropy(late(Tensor(np.ones((2, 4), np.float32))), np.array([0, 1])).backward()
        with pytest.raises(RuntimeError, match="before the first backward"):
            late.register_comm_hook(None, ch.fp16_compress_hook)
        differ = DistributedDataParallel(nn.mlp([4, 3], rng=0), comm)
        hook = ch.fp16_compress_hook if comm.Get_rank() == 0 else ch.bf16_compress_hook
        with pytest.raises(ValueError, match="different hooks"):
            differ.register_comm_hook(None, hook)
        wrong = DistributedDataParallel(nn.mlp([4, 3], rng=0), comm)
        wrong.register_comm_hook(ch.ErrorFeedbackState(), ch.topk_compress_hook)
        with pytest.raises(TypeError, match="TopKState"):
            cross_entropy(wrong(Tensor(np.ones((2, 4), np.float32))), np.array([0, 1])).backward()
        found.append("ok")
        return found

    assert sim.run(rank_main, 2) == [["ok"], ["ok"]]
    with pytest.raises(ValueError, match="ratio"):
        ch.TopKState(0.0)
    with pytest.raises(ValueError, match="unknown comm hook"):
        ch.comm_hook("fp8")


def test_a_hook_returning_the_wrong_dtype_is_named():
    def sum_only(state, bucket):  # forgets to cast back
        return ch.fp16_compress_hook(None, bucket)._work

    def rank_main(comm):
        ddp = DistributedDataParallel(nn.mlp([4, 3], rng=0), comm)
        ddp.register_comm_hook(None, sum_only)
        with pytest.raises(RuntimeError, match="averaged flat gradient, float32"):
            cross_entropy(ddp(Tensor(np.ones((2, 4), np.float32))), np.array([0, 1])).backward()
        return True

    assert sim.run(rank_main, 2) == [True, True]


@pytest.mark.parametrize("args, message", [
    (["--strategy", "single", "--comm-hook", "fp16"], "--comm-hook applies to --strategy ddp and diloco only"),
    (["--strategy", "ddp", "--topk-ratio", "0.1"], "--topk-ratio applies to --comm-hook topk only"),
    (["--strategy", "ddp", "--comm-hook", "topk", "--topk-ratio", "2"], r"must be in \(0, 1\]"),
])
def test_comm_hook_flags_usage_errors(args, message):
    with pytest.raises(ValueError, match=message):
        cli.train_config(cli.train_parser().parse_args(args))


def test_comm_hook_flags_become_the_config():
    config = cli.train_config(cli.train_parser().parse_args(["--strategy", "ddp", "--comm-hook", "topk",
                                                             "--topk-ratio", "0.05"]))
    assert (config.comm_hook, config.topk_ratio) == ("topk", 0.05)
    assert cli.train_config(cli.train_parser().parse_args(["--strategy", "ddp"])).comm_hook == "none"


# -- training ------------------------------------------------------------------------------------

MPI_EPOCHS = 3


def sim_train(name, p=2, epochs=10):
    config = train.TrainConfig(strategy="ddp", epochs=epochs, comm_hook=name, progress=False, topk_ratio=0.05)
    return sim.run(lambda comm: train_ddp(comm, config, DIGITS), p)[0]


DIGITS = data.load_digits(seed=0)


@pytest.mark.parametrize("name", ch.COMM_HOOKS)
def test_training_with_each_hook_on_the_sim_reaches_95_percent(name):
    """10 epochs on 2 ranks (top-k: 5 % of the entries; at 1 % it needs about 20 epochs)."""
    result = sim_train(name)
    assert result.test_accuracy >= 0.95, result.history[-1]
    assert result.figures.get("comm_hook", "none") == name


@pytest.mark.mpi
def test_train_ddp_fp16_under_mpiexec_sends_half_the_bytes():
    command = [mpiexec_or_skip(), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "minidist", "train", "--strategy",
               "ddp", "--comm-hook", "fp16", "--epochs", str(MPI_EPOCHS), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(r"final test_accuracy=0\.\d{4}", lines[-1]) and float(lines[-1].split("=")[1]) >= 0.9
    figures = dict(line.split("=", 1) for line in lines[:-1] if "=" in line and not line.startswith("epoch"))
    assert figures["comm_hook"] == "fp16"
    reference = sim_train("none", epochs=MPI_EPOCHS)  # the same run with fp32 all-reduces, its bytes counted on the sim
    assert int(figures["bytes_communicated"]) * 2 == reference.figures["bytes_communicated"]


# -- CuPy (skipped without a GPU): the same hooks on GPU buffers give the CPU's result -------------

@pytest.mark.skipif(not backend.cuda_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("name", ch.COMM_HOOKS)
def test_hooks_on_gpu_buffers_match_the_cpu(name):
    import cupy

    p, grads = 3, local_gradients(3)

    def rank_main(comm, device):
        state, hook = ch.comm_hook(name, 0.05)
        buffer = grads[comm.Get_rank()].copy()
        buffer = cupy.asarray(buffer) if device == "cuda" else buffer
        out = hook(state, ch.GradBucket(0, buffer, [], [0], True, CountingComm(comm), "ring")).wait()
        assert backend.device_of(out) == device and out.dtype == np.float32
        return backend.to_numpy(out)

    cpu, gpu = sim.run(rank_main, p, "cpu")[0], sim.run(rank_main, p, "cuda")[0]
    np.testing.assert_allclose(gpu, cpu, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not backend.cuda_available(), reason="needs CuPy and a GPU")
def test_training_with_fp16_hook_on_the_gpu():
    config = train.TrainConfig(strategy="ddp", epochs=10, comm_hook="fp16", progress=False, device="cuda")
    result = sim.run(lambda comm: train_ddp(comm, config, DIGITS), 2)[0]
    assert result.test_accuracy >= 0.95
    assert result.figures["bytes_communicated"] * 2 == sim_train("none").figures["bytes_communicated"]


def test_on_one_rank_a_hook_is_registered_but_sends_nothing():
    def rank_main(comm):
        plain, hooked = nn.mlp([4, 3], rng=0), DistributedDataParallel(nn.mlp([4, 3], rng=0), comm)
        hooked.register_comm_hook(ch.ErrorFeedbackState(), ch.int8_compress_hook)
        x, y = Tensor(np.arange(8, dtype=np.float32).reshape(2, 4)), np.array([0, 2])
        cross_entropy(plain(x), y).backward()
        cross_entropy(hooked(x), y).backward()
        for a, b in zip(plain.parameters(), hooked.parameters()):
            assert np.array_equal(a.grad, b.grad)  # the local gradient is the average: not quantised
        return hooked.stats.bytes_sent

    assert sim.run(rank_main, 1) == [0]


def test_bench_comm_hooks_quick(tmp_path):
    """The benchmark's smoke run: the byte ratios do not depend on the machine."""
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_comm_hooks.py"), "--quick", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bytes/step" in done.stdout and "test acc" in done.stdout
    rows = {row["hook"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == list(ch.COMM_HOOKS)
    assert rows["none"]["bytes_ratio"] == 1.0 and rows["fp16"]["bytes_ratio"] == rows["bf16"]["bytes_ratio"] == 0.5
    assert rows["int8"]["bytes_ratio"] < 0.5 and rows["topk"]["bytes_ratio"] < 0.1  # 2 ranks: (n+4)/(4n), 2 k 8/4n

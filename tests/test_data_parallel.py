"""DistributedDataParallel, data-parallel evaluation and ``--strategy ddp``.

The oracle is a single-process run on the global batch (tests/mpi/ddp_cases.py holds the
cases). They run on ``minidist.sim`` for P = 1..4, where the message trace also counts the
bytes, and under real ``mpiexec -n P python -m mpi4py`` for P = 1..4 (one launch per P runs
every case and reports failures).
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpitools import mpiexec_or_skip

from minidist import nn, sim
from minidist.collectives import TAGS, chunk_bounds
from minidist.parallel.data_parallel.ddp import DistributedDataParallel, compute_bucket_assignment
from minidist.parallel.data_parallel.inference import evaluate
from minidist.tensor import Tensor
from minidist.tracing import CountingComm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "mpi"))
import ddp_cases as cases  # noqa: E402 (the case list shared with the mpiexec worker)

WORLD_SIZES = [1, 2, 3, 4]


# -- the shared cases on sim --------------------------------------------------------------

@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("case", cases.CASES, ids=lambda c: c.__name__)
def test_case_on_sim(case, p):
    results = sim.run(case, p)
    assert len(results) == p


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ddp_counts_what_a_counting_comm_around_it_counts(p):
    """DDP counts through tracing.CountingComm (the one counting communicator): a second
    CountingComm wrapped around the rank's comm from outside sees the same bytes and
    messages, sent and received, and both agree with the sim's trace and the ring formula."""
    world = sim.World(p)

    def fn(comm):
        outer = CountingComm(comm, allow_collectives=True)
        run = cases.ddp_parameters(outer, 4, 2, cases.SMALL_BUCKET_MB, "ring")
        return run, (outer.messages, outer.nbytes, outer.messages_received, outer.bytes_received)

    for rank, (run, (messages, sent, messages_received, received)) in enumerate(world.run(fn)):
        stats, n = run["stats"], sum(run["buckets"])
        assert sent == stats.bytes_sent + stats.broadcast_bytes == world.bytes_sent(rank)
        assert messages == world.messages_sent(rank) and messages_received == world.messages_received(rank)
        broadcast_received = (rank != 0) * n * 8  # one float64 group from the tree's parent
        assert received == stats.bytes_received + broadcast_received == world.bytes_received(rank)
        # exact ring count: each bucket sends all chunks but its own in reduce-scatter and
        # all but chunk rank+1 in all-gather; about 2(P-1)/P * N elements per rank and step
        exact = 0
        for numel in run["buckets"]:
            chunks = [len(c) for c in np.array_split(np.arange(numel), p)]
            exact += 2 * numel - chunks[rank] - chunks[(rank + 1) % p]
        assert stats.bytes_sent == 2 * exact * 8  # two steps, float64
        per_step = 2 * (p - 1) / p * n * 8
        assert abs(stats.bytes_sent / 2 - per_step) <= 2 * 8 * len(run["buckets"])
        assert abs(stats.bytes_received / 2 - per_step) <= 2 * 8 * len(run["buckets"])


def test_no_sync_backward_sends_nothing():
    def fn(comm):
        model = cases.make_model()
        ddp = DistributedDataParallel(model, comm)
        X, y = cases.make_data(1, 4, 1)
        with ddp.no_sync():
            cases.loss_of(ddp, X, y).backward()
        return ddp.stats

    world = sim.World(2)
    stats0, stats1 = world.run(fn)
    assert stats0.all_reduce_calls == stats1.all_reduce_calls == stats0.synced_steps == 0
    assert world.bytes_sent(0) == stats0.broadcast_bytes > 0 and world.bytes_sent(1) == 0  # the broadcast only
    assert all(m.kind == "object" or m.tag == TAGS["broadcast"] for m in world.trace)  # agreement, broadcast only


def test_stats_count_calls_and_time():
    def fn(comm):
        run = cases.ddp_parameters(comm, 4, 3, cases.SMALL_BUCKET_MB)
        return run["stats"], len(run["buckets"])

    for stats, buckets in sim.run(fn, 2):
        assert stats.synced_steps == 3 and stats.all_reduce_calls == 3 * buckets
        assert stats.comm_seconds > 0 and stats.compute_seconds > 0 and stats.messages_sent > 0


# -- bucket assignment ---------------------------------------------------------------------

def test_buckets_fill_in_reverse_order_up_to_the_cap():
    params = [Tensor(np.zeros(n, np.float32), requires_grad=True) for n in (100, 10, 300, 20, 50)]
    mib = 2**20
    assert compute_bucket_assignment(params, 25) == [[4, 3, 2, 1, 0]]
    # bytes, last first: 200, 80 | 1200 (bigger than the cap: alone) | 40, 400
    assert compute_bucket_assignment(params, 400 / mib) == [[4, 3], [2], [1], [0]]  # 40 + 400 > 400
    assert compute_bucket_assignment(params, 500 / mib) == [[4, 3], [2], [1, 0]]
    assert compute_bucket_assignment(params, None) == [[4], [3], [2], [1], [0]]
    assert compute_bucket_assignment(params, 0) == [[4], [3], [2], [1], [0]]


def test_a_new_bucket_starts_where_the_dtype_changes():
    params = [Tensor(np.zeros(4, dtype), requires_grad=True) for dtype in ("float32", "float32", "float64")]
    assert compute_bucket_assignment(params, 25) == [[2], [1, 0]]


def test_mixed_dtypes_average_correctly():
    class Mixed(nn.Module):
        def __init__(self, rank):
            super().__init__()
            self.a = nn.Linear(3, 2, rng=rank, dtype="float32")
            self.b = nn.Linear(2, 2, rng=rank, dtype="float64")

        def forward(self, x):
            return self.b(self.a(x))

    def fn(comm):
        model = Mixed(comm.Get_rank())
        ddp = DistributedDataParallel(model, comm)
        x = np.full((2, 3), comm.Get_rank() + 1.0, np.float32)
        ddp(Tensor(x)).sum().backward()
        return len(ddp.buckets), [p.grad for p in model.parameters()]

    (buckets, g0), (_, g1) = sim.run(fn, 2)
    assert buckets == 2
    for a, b in zip(g0, g1):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_bad_bucket_cap_is_rejected():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        compute_bucket_assignment([Tensor(np.zeros(2), requires_grad=True)], -1)
    with pytest.raises(ValueError, match="bucket_cap_mb must be >= 0"):
        sim.run(lambda comm: DistributedDataParallel(cases.make_model(), comm, bucket_cap_mb=-1), 2)
    with pytest.raises(ValueError, match="unknown algorithm 'butterfly'"):
        sim.run(lambda comm: DistributedDataParallel(cases.make_model(), comm, algorithm="butterfly"), 2)


# -- errors: clear messages on every rank, never a hang ---------------------------------

def test_model_differing_across_ranks_fails_on_every_rank():
    world = sim.World(3)
    with pytest.raises(ValueError, match="differs across ranks"):
        world.run(lambda comm: DistributedDataParallel(nn.mlp([4, 3 + (comm.Get_rank() == 2), 2], rng=0), comm))
    assert sorted(world.errors) == [0, 1, 2]
    assert all(isinstance(e, ValueError) and "rank 2 has 0.weight (4, 4)" in str(e) for e in world.errors.values())


def test_a_different_number_of_parameters_is_named():
    def fn(comm):
        sizes = [4, 3, 2] if comm.Get_rank() == 0 else [4, 3, 3, 2]
        DistributedDataParallel(nn.mlp(sizes, rng=0), comm)

    with pytest.raises(ValueError, match="rank 0 has 4 parameters, rank 1 has 6"):
        sim.run(fn, 2)


def test_settings_differing_across_ranks_fail():
    with pytest.raises(ValueError, match="disagree on the settings"):
        sim.run(lambda comm: DistributedDataParallel(cases.make_model(), comm, bucket_cap_mb=1 + comm.Get_rank()), 2)


def test_parameter_unused_on_one_rank_only_is_an_error_not_a_hang():
    """Rank 1 skips the second head: rank 0 waits in that bucket's all-reduce, rank 1
    fails at its next forward, and the sim stops rank 0 -- an error, not a hang."""

    class MaybeTwoHeads(cases.TwoHeads):
        def __init__(self, use_both):
            super().__init__()
            self.use_both = use_both

        def forward(self, x):
            out = self.body(x)
            return out + self.unused(out).sum() * 0 if self.use_both else out

    def fn(comm):
        ddp = DistributedDataParallel(MaybeTwoHeads(comm.Get_rank() == 0), comm, bucket_cap_mb=None)
        X, y = cases.make_data(1, 4, 1)
        for _ in range(2):
            cases.loss_of(ddp, X, y).backward()

    with pytest.raises(RuntimeError, match=r"did not produce gradients for \['unused.bias', 'unused.weight'\]"):
        sim.World(2, timeout=30).run(fn)


def test_frozen_parameters_are_broadcast_but_not_averaged():
    def fn(comm):
        model = cases.TwoHeads()
        for p in model.unused.parameters():
            p.requires_grad = False
        if comm.Get_rank() == 1:
            model.unused.weight.data += 1.0
        ddp = DistributedDataParallel(model, comm)
        X, y = cases.make_data(1, 4, 1)
        cases.loss_of(ddp, X, y).backward()
        ddp(Tensor(X))  # no error: frozen parameters need no gradient
        return model.unused.weight.data.copy(), sum(len(b.params) for b in ddp.buckets)

    (w0, n0), (w1, _) = sim.run(fn, 2)
    assert np.array_equal(w0, w1) and n0 == 6


def test_not_a_communicator_and_no_parameters():
    with pytest.raises(TypeError, match="needs a communicator"):
        DistributedDataParallel(cases.make_model(), comm=None)
    with pytest.raises(ValueError, match="no parameters"):
        sim.run(lambda comm: DistributedDataParallel(nn.Sequential(nn.ReLU()), comm), 2)


def test_passthroughs():
    def fn(comm):
        model = cases.make_model()
        ddp = DistributedDataParallel(model, comm)
        assert ddp.parameters() == model.parameters() and ddp.module is model
        assert list(ddp.state_dict()) == list(model.state_dict())
        x = np.ones((2, cases.SIZES[0]))
        assert np.array_equal(ddp(Tensor(x)).data, model(Tensor(x)).data)
        ddp.load_state_dict(cases.make_model(9).state_dict())
        assert np.array_equal(model.parameters()[0].data, cases.make_model(9).parameters()[0].data)
        ddp.zero_grad()
        assert "DistributedDataParallel(rank" in repr(ddp)
        return True

    assert sim.run(fn, 2) == [True, True]


# -- data-parallel evaluation --------------------------------------------------------------

def test_shards_are_contiguous_and_cover_everything():
    for n in (0, 1, 3, 10, 103):
        for p in (1, 2, 3, 4, 7):
            bounds = chunk_bounds(n, p)
            sizes = [len(c) for c in np.array_split(np.arange(n), p)]
            assert [stop - start for start, stop in bounds] == sizes
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_evaluate_reads_the_chunk_bounds_shard_of_each_rank():
    class Recorder(nn.Module):  # counts the samples it is asked to classify
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(cases.SIZES[0], cases.SIZES[-1], rng=0, dtype="float64")
            self.seen = []

        def forward(self, x):
            self.seen.extend(np.asarray(x.data)[:, 0].tolist())
            return self.head(x)

    X = np.arange(10.0).repeat(cases.SIZES[0]).reshape(10, cases.SIZES[0])  # row i holds i

    def fn(comm):
        model = Recorder()
        evaluate(model, X, np.zeros(10, int), comm, batch_size=2)
        return model.seen

    assert sim.run(fn, 3) == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]  # array_split's 4, 3, 3


def test_evaluate_sends_one_gather_only():
    world = sim.World(4)
    X = np.random.default_rng(0).standard_normal((10, cases.SIZES[0]))
    y = np.arange(10) % cases.SIZES[-1]
    world.run(lambda comm: evaluate(cases.make_model(), X, y, comm))
    tags = {m.tag for m in world.trace if m.kind == "array"}
    assert tags == {7704}  # all_gather's tag: nothing else moved
    assert world.bytes_sent(0) == 3 * 3 * 8  # ring all-gather: 3 blocks of 3 int64


def test_evaluate_different_test_sets_is_an_error():
    from minidist.p2p import CollectiveError

    def fn(comm):
        n = 10 + comm.Get_rank()
        return evaluate(cases.make_model(), np.zeros((n, cases.SIZES[0])), np.zeros(n, int), comm)

    with pytest.raises(CollectiveError, match="same test set"):
        sim.run(fn, 2)


# -- under real MPI ------------------------------------------------------------------------

def mpirun(n, *args, timeout=60):
    mpiexec = mpiexec_or_skip()
    command = [mpiexec, "-n", str(n), sys.executable, "-m", "mpi4py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(command)} took more than {timeout} s:\n{e.stdout}\n{e.stderr}")


@pytest.mark.mpi
@pytest.mark.parametrize("p", WORLD_SIZES)
def test_cases_under_mpiexec(p):
    done = mpirun(p, str(ROOT / "tests" / "mpi" / "ddp_cases.py"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["world_size"] == p
    assert report["failures"] == [], "\n".join(report["failures"])
    assert set(report["results"]) == {c.__name__ for c in cases.CASES}


@pytest.mark.mpi
def test_a_rank_that_exits_early_ends_the_job_naming_it():
    """Rank 1 calls sys.exit(0) after constructing DDP; rank 0 trains on. Rank 0's all-reduce
    reaches the collectives' deadline (2 s here) and the job ends naming rank 1."""
    start = time.perf_counter()
    done = mpirun(2, str(ROOT / "tests" / "mpi" / "ddp_rank_exits.py"), "2", timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "CollectiveTimeout" in output and "not heard from rank 1 " in output, output
    assert "step 0 done" not in output  # the step that needed rank 1 never completed
    assert time.perf_counter() - start < 30


@pytest.mark.mpi
def test_train_ddp_under_mpiexec_two_ranks():
    done = mpirun(2, "-m", "minidist", "train", "--strategy", "ddp", "--epochs", "3", "--no-progress", timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(r"final test_accuracy=0\.\d{4}", lines[-1]) and float(lines[-1].split("=")[1]) >= 0.9
    figures = dict(line.split("=", 1) for line in lines[:-1] if "=" in line and not line.startswith("epoch"))
    assert figures["ranks"] == "2" and figures["global_batch"] == "64" and figures["lr"] == "0.1"
    assert int(figures["bytes_communicated"]) > 0 and float(figures["comm_seconds"]) >= 0
    assert float(figures["compute_seconds"]) > 0
    assert sum(line.startswith("epoch ") for line in lines) == 3  # rank 0 only


@pytest.mark.mpi
def test_evaluate_under_mpiexec_matches_single_process(tmp_path):
    rng = np.random.default_rng(0)
    model = nn.mlp([64, 32, 10], rng=1)
    for p in model.parameters():
        p.data += rng.standard_normal(p.shape).astype(np.float32) * 0.01
    np.savez(tmp_path / "model.npz", **model.state_dict())
    done = mpirun(3, "-m", "minidist", "evaluate", "--checkpoint", str(tmp_path / "model.npz"), timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert "ranks=3" in lines and "shard_sizes=150,150,150" in lines and "matches_single_process=True" in lines
    assert lines[-1].startswith("test_accuracy=")


# -- the command line in one process (a world of one) --------------------------------------

def run_cli(*args, timeout=90):
    return subprocess.run([sys.executable, "-m", "minidist", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_train_ddp_in_a_world_of_one():
    done = run_cli("train", "--strategy", "ddp", "--epochs", "2", "--no-progress")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "ranks=1" in lines and "bytes_communicated=0" in lines and lines[-1].startswith("final test_accuracy=")


@pytest.mark.parametrize("args,message", [
    (["--num-servers", "2"], "--num-servers applies to --strategy ps only"),
    (["--ps-mode", "async"], "--ps-mode applies to --strategy ps only"),
    (["--staleness", "5"], "--staleness applies to --strategy ps only"),
])
def test_train_ddp_usage_errors(args, message):
    done = run_cli("train", "--strategy", "ddp", *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("args,status,message", [
    (["--bogus"], 2, "unrecognized arguments"),
    (["--dataset", "mnist"], 2, "needs --data-dir"),
    (["--checkpoint", "/nonexistent/model.npz"], 1, "No such file"),
])
def test_evaluate_errors(args, status, message):
    done = run_cli("evaluate", *args)
    assert done.returncode == status and message in done.stderr and "Traceback" not in done.stderr


def test_evaluate_checkpoint_for_another_dataset_is_a_usage_error(tmp_path):
    np.savez(tmp_path / "m.npz", **nn.mlp([20, 5, 10], rng=0).state_dict())
    done = run_cli("evaluate", "--checkpoint", str(tmp_path / "m.npz"))
    assert done.returncode == 2 and "a model for 20 features" in done.stderr


def test_train_ddp_without_mpi4py_names_the_fix():
    code = ("import sys; sys.modules['mpi4py'] = None; from minidist.__main__ import main; "
            "sys.exit(main(['train', '--strategy', 'ddp', '--epochs', '1']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert done.returncode == 1 and "pip install mpi4py mpich" in done.stderr and "Traceback" not in done.stderr


# -- overlap: communication during backward ----------------------------------------------

def _timed_step(comm, overlap):
    """One step of the cases' MLP in several buckets; returns (time the first layer's
    backward ended, the step's StepTimeline)."""
    ddp = DistributedDataParallel(cases.make_model(), comm, bucket_cap_mb=cases.SMALL_BUCKET_MB, algorithm="ring",
                                  overlap=overlap)
    X, y = cases.make_data(comm.Get_size(), 4, 1)
    x = Tensor(X[:4], requires_grad=True)
    ended = []
    x.register_post_accumulate_grad_hook(lambda _: ended.append(time.perf_counter()))
    from minidist.functions import cross_entropy
    cross_entropy(ddp(x), y[:4]).backward()
    return ended[0], ddp.timeline


def test_overlap_backward_goes_on_while_bucket_zero_is_in_flight():
    """On a slow simulated link (20 kB/s: a 352-byte bucket takes ~18 ms a message), with
    overlap the first layer's backward ends before bucket 0's all-reduce has finished; with
    overlap=False bucket 0 is finished first (the hook waited for it)."""
    for overlap in (True, False):
        results = sim.World(2, bandwidth=2e4).run(_timed_step, overlap)
        for first_layer_end, timeline in results:
            index, _, ready, done = timeline.buckets[0]
            assert index == 0 and ready < first_layer_end
            if overlap:
                assert done > first_layer_end, (done, first_layer_end)
                assert timeline.backward_end < timeline.synced
            else:
                assert done < first_layer_end, (done, first_layer_end)


def test_step_timeline_hidden_fraction():
    """hidden_fraction: the share of the union of the buckets' intervals during compute
    (forward start to backward end, less the blocked intervals)."""
    from minidist.parallel.data_parallel.ddp import StepTimeline
    t = StepTimeline(0.0, 10.0, 14.0, [(0, 8, 2.0, 6.0), (1, 8, 5.0, 8.0), (2, 8, 9.0, 14.0)],
                     [(2.0, 2.5), (10.0, 14.0)])
    assert t.comm_intervals() == [(2.0, 8.0), (9.0, 14.0)]
    assert t.compute_intervals() == [(0.0, 2.0), (2.5, 10.0)]
    assert t.hidden_fraction() == pytest.approx((5.5 + 1.0) / 11.0)
    blocking = StepTimeline(0.0, 10.0, 10.0, [(0, 8, 2.0, 6.0)], [(2.0, 6.0)])  # overlap=False: nothing hidden
    assert blocking.hidden_fraction() == 0.0
    assert StepTimeline(0.0, 1.0, 1.0, []).hidden_fraction() == 1.0


def test_one_rank_copies_and_sends_nothing():
    """A world of one: no all-reduce, no bucket buffer, and the gradients are the module's
    own arrays (bitwise the single-process gradients)."""
    def fn(comm):
        from minidist.functions import cross_entropy
        X, y = cases.make_data(1, 6, 1)
        plain = cases.make_model()
        cross_entropy(plain(Tensor(X)), y).backward()
        ddp = DistributedDataParallel(cases.make_model(), comm, bucket_cap_mb=cases.SMALL_BUCKET_MB)
        cross_entropy(ddp(Tensor(X)), y).backward()
        ddp.verify_synced()
        assert ddp.stats.synced_steps == 1 and ddp.stats.all_reduce_calls == 0
        assert all(b.buffer is None for b in ddp.buckets)
        return [p.grad for p in plain.parameters()], [p.grad for p in ddp.parameters()]

    [(expected, got)] = sim.run(fn, 1)
    assert all(np.array_equal(a, b) for a, b in zip(expected, got))


def test_a_rank_that_raises_mid_backward_stops_every_rank():
    """Rank 1 raises from a layer's backward after bucket 0's all-reduce has started: the run
    ends on every rank with rank 1's error (the others stop at their next communication
    call, inside the in-flight all-reduces), in well under the deadline."""
    from minidist.functions import cross_entropy

    def fn(comm):
        model = cases.make_model()
        ddp = DistributedDataParallel(model, comm, bucket_cap_mb=cases.SMALL_BUCKET_MB)
        if comm.Get_rank() == 1:
            def fail(_):
                raise ValueError("rank 1 failed mid-backward")
            model.parameters()[0].register_post_accumulate_grad_hook(fail)  # the first layer: the last hook
        X, y = cases.make_data(2, 4, 1)
        cross_entropy(ddp(Tensor(X[:4])), y[:4]).backward()
        return ddp.stats

    start = time.perf_counter()
    with pytest.raises(ValueError, match="rank 1 failed mid-backward") as info:
        sim.World(2, timeout=30).run(fn)
    assert info.value.rank == 1 and time.perf_counter() - start < 10

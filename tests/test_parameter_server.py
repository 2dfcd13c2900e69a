"""Parameter servers (minidist.parallel.parameter_server): sync equals one process with the
global batch, ssp never exceeds its staleness bound, async runs to the end, traffic per
server per step is 2 N M / K, and bad worlds give clear errors. Oracles: a single-process
run with batch N x b (float64, 1e-10), sim's message trace, the formula."""
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpitools import mpiexec_or_skip

from minidist import data, nn, optim, sim
from minidist.functions import cross_entropy
from minidist.parallel import parameter_server as ps
from minidist.parallel.parameter_server import protocol
from minidist.tensor import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "mpi"))
import ps_worker_stops  # noqa: E402 (the job shared with the mpiexec test)

SIZES = [7, 5, 3]  # 7*5 + 5 + 5*3 + 3 = 58 parameters: not a multiple of 3 servers


def model_fn(dtype="float64"):
    return lambda: nn.mlp(SIZES, rng=3, dtype=dtype)


def toy_data(n, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, SIZES[0]))
    y = rng.integers(0, SIZES[-1], n)
    return X, y


def flat(model):
    return nn.parameters_to_vector(model.parameters())


def single_process(X, y, batch_size, epochs, lr, momentum, weight_decay, seed):
    """The oracle: one process, batch N x b, the same order of samples as the workers'
    DistributedSampler shards put together (one replica, same seed)."""
    model = model_fn()()
    opt = optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    loader = data.DataLoader(X, y, batch_size=batch_size,
                             sampler=data.DistributedSampler(len(X), 1, 0, shuffle=True, seed=seed))
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            cross_entropy(model(Tensor(xb)), yb).backward()
            opt.step()
    return flat(model)


def slow_worker_0(worker, clock):
    if worker == 0:
        time.sleep(0.004)


# ------------------------------------------------------------------------------ sharding


@pytest.mark.parametrize("elements,servers", [(58, 1), (58, 2), (58, 3), (9610, 3), (5, 5), (101, 7)])
def test_shards_are_contiguous_balanced_and_deterministic(elements, servers):
    params = [nn.Parameter(np.zeros(elements - 2)), nn.Parameter(np.zeros((1, 2)))]
    ranges = ps.FlatLayout(params, servers).ranges
    assert ranges == ps.FlatLayout(params, servers).ranges
    assert ranges[0][0] == 0 and ranges[-1][1] == elements
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == [len(chunk) for chunk in np.array_split(np.arange(elements), servers)]


def test_more_servers_than_parameters_is_an_error():
    with pytest.raises(ValueError, match="cannot shard 3 parameters over 4 servers .* use fewer servers"):
        ps.FlatLayout([nn.Parameter(np.zeros(3))], 4)


def test_mixed_dtypes_cannot_be_sharded():
    params = [nn.Parameter(np.zeros(3, np.float32)), nn.Parameter(np.zeros(2, np.float64))]
    with pytest.raises(ValueError, match="one dtype"):
        ps.FlatLayout(params, 1)


# ------------------------------------------------------------------------------ sync


@pytest.mark.parametrize("servers,workers", [(1, 1), (1, 2), (1, 3), (2, 1), (2, 3), (3, 2)])
@pytest.mark.parametrize("mode", ["sync", "ssp"])  # ssp with staleness 0 is sync
def test_sync_equals_single_process_with_global_batch(servers, workers, mode):
    b, steps_per_epoch, epochs = 4, 3, 2
    X, y = toy_data(workers * b * steps_per_epoch)
    kw = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    results = sim.run(ps.train_parameter_server, servers + workers, model_fn(), X, y, num_servers=servers,
                      mode=mode, staleness=0, epochs=epochs, batch_size=b, seed=5, **kw)
    expected = single_process(X, y, workers * b, epochs, seed=5, **kw)
    np.testing.assert_allclose(ps.final_parameters(results), expected, rtol=0, atol=1e-10)
    reporter = results[servers]
    np.testing.assert_allclose(flat(reporter.model), expected, rtol=0, atol=1e-10)
    for s in results[:servers]:
        assert s.version == steps_per_epoch * epochs  # one update per clock
        assert s.staleness_histogram == {0: workers * steps_per_epoch * epochs}
    assert all(r.steps == steps_per_epoch * epochs for r in results[servers:])


def test_sync_is_deterministic():
    X, y = toy_data(48)
    run = lambda: ps.final_parameters(sim.run(ps.train_parameter_server, 5, model_fn(), X, y, num_servers=2,
                                              mode="sync", batch_size=4, lr=0.1, momentum=0.9,
                                              step_hook=slow_worker_0))
    assert np.array_equal(run(), run())


# ------------------------------------------------------------------------------ traffic


@pytest.mark.parametrize("servers", [1, 2, 3])
def test_traffic_per_server_per_step_is_2NM_over_K(servers):
    workers, b, steps = 3, 4, 5
    X, y = toy_data(workers * b * steps)
    world = sim.World(servers + workers)
    results = world.run(ps.train_parameter_server, model_fn(), X, y, num_servers=servers, mode="async",
                        batch_size=b, lr=0.05)
    itemsize, elements = 8, 58
    M = elements * itemsize
    for s, stats in enumerate(results[:servers]):
        shard_bytes = (stats.stop - stats.start) * itemsize
        # sim's trace: gradients in, parameters out
        pushed = sum(m.nbytes for m in world.trace if m.dest == s and m.tag == protocol.TAG_GRAD)
        pulled = sum(m.nbytes for m in world.trace if m.source == s and m.tag == protocol.TAG_PARAMS)
        assert pushed + pulled == 2 * workers * shard_bytes * steps
        assert (stats.bytes_received, stats.bytes_sent) == (pushed, pulled)  # our counters agree
        assert stats.steps == steps and stats.bytes_per_step == 2 * workers * shard_bytes
        assert abs(stats.bytes_per_step - 2 * workers * M / servers) <= 2 * workers * itemsize  # imbalance <= 1 element
        # and nothing else moved: control headers, versions, the final shard to the reporter
        requests = workers * (2 * steps + 1)
        control = requests * protocol.HEADER_BYTES + workers * steps * protocol.VERSION_BYTES
        assert stats.control_bytes == control
        assert world.bytes_received(s) + world.bytes_sent(s) == pushed + pulled + control + shard_bytes
    assert sum(r.stop - r.start for r in results[:servers]) == elements
    for w in results[servers:]:
        assert w.bytes_sent == w.bytes_received == steps * M


# ------------------------------------------------------------------------------ staleness


@pytest.mark.parametrize("servers,bound", [(1, 1), (1, 2), (2, 2)])
def test_ssp_staleness_never_exceeds_the_bound(servers, bound):
    workers, b, steps = 3, 2, 12
    X, y = toy_data(workers * b * steps)
    results = sim.run(ps.train_parameter_server, servers + workers, model_fn(), X, y, num_servers=servers,
                      mode="ssp", staleness=bound, batch_size=b, lr=0.05, step_hook=slow_worker_0)
    for s in results[:servers]:
        assert sum(s.staleness_histogram.values()) == s.gradients == workers * steps
        assert s.max_staleness == bound  # the fast workers run ahead to the bound, never past it
        assert s.version == steps
    fast, slow = results[servers + 1], results[servers]
    assert fast.wait_seconds > slow.wait_seconds  # the fast workers are the ones held back


def test_async_completes_and_measures_staleness_with_uneven_workers():
    workers, b, steps = 3, 2, 10
    X, y = toy_data(workers * b * steps)
    results = sim.run(ps.train_parameter_server, 1 + workers, model_fn(), X, y, mode="async", batch_size=b,
                      lr=0.05, momentum=0.5, step_hook=slow_worker_0)
    server = results[0]
    assert server.version == server.gradients == workers * steps  # every gradient its own update
    assert sum(server.staleness_histogram.values()) == workers * steps
    assert server.max_staleness > 0
    assert np.all(np.isfinite(ps.final_parameters(results)))


def test_workers_with_different_step_counts_shut_down_cleanly():
    """A worker that stops early (DONE) no longer holds back the clocks of the others."""
    steps = {1: 2, 2: 5}

    def job(comm):
        model = model_fn()()
        if comm.Get_rank() == 0:
            return ps.ParameterServer(comm, model, mode="sync", lr=0.1).serve()
        worker = ps.Worker(comm, model)
        xb, yb = toy_data(4, seed=comm.Get_rank())
        for _ in range(steps[comm.Get_rank()]):
            worker.pull()
            model.zero_grad()
            cross_entropy(model(Tensor(xb)), yb).backward()
            worker.push()
        return worker.finish(receive_final=comm.Get_rank() == 1)

    results = sim.run(job, 3)
    assert results[0].version == 5 and results[0].gradients == 7
    assert results[1].servers[0].version == 5
    np.testing.assert_array_equal(flat(results[1].model), results[0].shard)


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("size,servers,mode,staleness,message", [
    (1, 1, "sync", 0, "a world of 1 rank"),
    (4, 4, "sync", 0, "leave no worker; use --num-servers <= 3"),
    (4, 0, "sync", 0, "at least 1 server"),
    (4, 1, "ssp", -1, "staleness must be an integer >= 0"),
    (4, 1, "hogwild", 0, "mode must be one of"),
])
def test_bad_worlds_are_clear_errors(size, servers, mode, staleness, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ps.check_world(size, servers, mode, staleness)
    X, y = toy_data(8)
    with pytest.raises(ValueError, match=re.escape(message)):
        sim.run(ps.train_parameter_server, size, model_fn(), X, y, num_servers=servers, mode=mode,
                staleness=staleness)


def test_roles_and_push_without_backward_are_errors():
    def job(comm):
        model = model_fn()()
        if comm.Get_rank() == 0:
            with pytest.raises(ValueError, match="is a server"):
                ps.Worker(comm, model)
            return ps.ParameterServer(comm, model).serve()
        with pytest.raises(ValueError, match="is a worker"):
            ps.ParameterServer(comm, model)
        worker = ps.Worker(comm, model)
        with pytest.raises(ValueError, match="call loss.backward"):
            worker.push()
        return worker.finish(receive_final=True)

    results = sim.run(job, 2)
    assert results[0].gradients == 0 and results[1].steps == 0


def test_a_worker_that_stops_early_is_named_by_the_server():
    """Worker rank 2 returns after one push without saying DONE: the server's deadline
    ends the run with an error naming rank 2 (not the waiting server), before the other
    worker's longer deadline; on the sim as under MPI (the same polling code)."""
    world = sim.World(3, timeout=30)
    start = time.perf_counter()
    with pytest.raises(ps.ParameterServerTimeout, match="no request from worker rank 2,") as error:
        world.run(ps_worker_stops.job, 0.3)
    assert error.value.missing == [2] and error.value.rank == 0
    assert time.perf_counter() - start < 5
    assert isinstance(world.errors[1], sim.RankAborted)  # worker 1 still waited: the server spoke first


def test_a_server_that_never_answers_is_named_by_the_worker():
    def job(comm):
        if comm.Get_rank() == 0:
            return None  # a server that died before serving
        ps.Worker(comm, model_fn()(), timeout=0.1).pull()

    deadline = 0.1 + protocol.WORKER_MARGIN
    with pytest.raises(ps.ParameterServerTimeout, match="worker rank 1: server rank 0 did not answer the pull "
                                                        rf"of clock 0 \(deadline {deadline:g} s") as error:
        sim.World(2, timeout=30).run(job)
    assert error.value.missing == [0]


def test_a_worker_waits_one_timeout_and_the_margin_not_twice_the_timeout():
    """The one-deadline rule: server and workers share one timeout; a worker waits
    timeout + WORKER_MARGIN (here 3 + 1 s), not 2 x timeout (6 s, the old patience). The server
    is alive but silent (outside any wait, so the sim sees no deadlock and the clock runs)."""
    import threading

    timeout, stop = 3.0, threading.Event()

    def job(comm):
        if comm.Get_rank() == 0:
            stop.wait(30)  # a server stuck in a long computation
            return None
        start = time.perf_counter()
        try:
            ps.Worker(comm, model_fn()(), timeout=timeout).pull()
        except ps.ParameterServerTimeout as error:
            return time.perf_counter() - start, error.missing
        finally:
            stop.set()

    waited, missing = sim.World(2, timeout=60).run(job)[1]
    assert missing == [0]
    assert timeout + protocol.WORKER_MARGIN - 0.05 <= waited < 2 * timeout - 0.5, waited


def test_the_servers_deadline_counts_from_the_pull_it_holds_back():
    """Worker 1 waits in a pull the server holds back (ssp, bound 2: worker 3 never pushes),
    while worker 2 keeps the server busy with a request every 0.15 s for 1.8 s. The server's
    deadline counts from worker 1's pull, not from its last request, so it speaks first
    (timeout 0.6 s; worker 1 waits 0.6 + WORKER_MARGIN): it names worker 3, and worker 1 is
    stopped (RankAborted), not the one that raises. With a deadline restarted by every
    request, worker 1 would blame the server instead."""
    import threading

    timeout, stop = 0.6, threading.Event()

    def job(comm):
        rank, model = comm.Get_rank(), model_fn()()
        if rank == 0:
            return ps.ParameterServer(comm, model, mode="ssp", staleness=2, timeout=timeout).serve()
        if rank == 3:
            return None  # never pushes: clock 0 never completes
        worker = ps.Worker(comm, model, timeout=timeout)
        X, y = toy_data(4, seed=rank)
        try:
            for step in range(3 if rank == 1 else 12):
                worker.pull()  # worker 1's fourth pull (clock 3 > version 0 + bound 2) is held back
                model.zero_grad()
                cross_entropy(model(Tensor(X)), y).backward()
                if rank == 2:
                    time.sleep(0.15)
                    worker.versions = worker.pull()  # one more request: the server hears from rank 2
                worker.push() if rank == 1 or step < 2 else None
            worker.pull()
        finally:
            stop.set()

    world = sim.World(4, timeout=60)
    with pytest.raises(ps.ParameterServerTimeout, match="no request from worker rank") as error:
        world.run(job)
    assert error.value.rank == 0 and 3 in error.value.missing
    assert isinstance(world.errors[1], sim.RankAborted)


@pytest.mark.mpi
def test_a_worker_that_stops_early_under_mpiexec_ends_the_job_naming_it():
    command = [mpiexec_or_skip(), "-n", "3", sys.executable, "-m", "mpi4py",
               str(ROOT / "tests" / "mpi" / "ps_worker_stops.py"), "1.0"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode != 0
    assert "ParameterServerTimeout: parameter server rank 0: no request from worker rank 2," in result.stderr
    assert time.perf_counter() - start < 30


def test_negative_staleness_is_a_usage_error_from_the_cli():
    result = subprocess.run([sys.executable, "-m", "minidist", "train", "--strategy", "ps", "--ps-mode", "ssp",
                             "--staleness", "-1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "argument --staleness: must be an integer >= 0, got -1" in result.stderr


def test_world_of_one_is_a_usage_error_from_the_cli():
    pytest.importorskip("mpi4py")
    result = subprocess.run([sys.executable, "-m", "minidist", "train", "--strategy", "ps", "--no-progress"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "a world of 1 rank" in result.stderr and "mpiexec -n 4" in result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------------ real MPI


def train_under_mpi(n, *flags, timeout=120):
    command = [mpiexec_or_skip(), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "minidist", "train",
               "--strategy", "ps", "--no-progress", *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    figures = dict(line.split("=", 1) for line in result.stdout.splitlines()
                   if "=" in line and not line.startswith("epoch "))
    return result, figures


@pytest.mark.mpi
def test_mpi_sync_reaches_95_percent_and_the_formula():
    result, fig = train_under_mpi(4, "--ps-mode", "sync")
    assert result.returncode == 0, result.stderr
    assert float(fig["final test_accuracy"]) >= 0.95
    assert (fig["servers"], fig["workers"], fig["max_staleness"]) == ("1", "3", "0")
    assert fig["bytes_per_server_per_step"] == fig["formula_2NM_over_K"] == str(2 * 3 * 9610 * 4)
    assert sum(line.startswith("epoch ") for line in result.stdout.splitlines()) == 20  # the default --epochs


@pytest.mark.mpi
def test_mpi_async_reaches_93_percent():
    result, fig = train_under_mpi(4, "--ps-mode", "async")
    assert result.returncode == 0, result.stderr
    assert float(fig["final test_accuracy"]) >= 0.93
    assert fig["bytes_per_server_per_step"] == fig["formula_2NM_over_K"]


@pytest.mark.mpi
def test_mpi_ssp_with_two_servers_keeps_the_bound():
    result, fig = train_under_mpi(4, "--ps-mode", "ssp", "--staleness", "1", "--num-servers", "2", "--epochs", "3")
    assert result.returncode == 0, result.stderr
    assert (fig["servers"], fig["workers"]) == ("2", "2") and int(fig["max_staleness"]) <= 1
    histograms = [eval(h) for h in re.findall(r"\{[^}]*\}", fig["staleness_histogram"])]
    assert len(histograms) == 2 and all(max(h) <= 1 and sum(h.values()) == 2 * 3 * 22 for h in histograms)
    assert fig["bytes_per_server_per_step"] == f"{2 * 2 * 4805 * 4} {2 * 2 * 4805 * 4}"
    assert fig["formula_2NM_over_K"] == str(2 * 2 * 9610 * 4 // 2)

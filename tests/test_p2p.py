"""minidist.p2p, the one message layer: its wait (deadline, blame, cancelled receives, the
sim's deadlock detection), the pipeline executor on it, and the rule that no private name
crosses the modules of the message layer. Oracles: the ranks that were silent, the clock."""
import ast
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from minidist import nn, p2p, sim
from minidist.functions import cross_entropy
from minidist.parallel.pipeline import executor as E

ROOT = Path(__file__).resolve().parents[1]


class Pending:
    """A request that never completes (a peer that never answers); counts its cancels."""

    def __init__(self):
        self.cancelled = 0

    def Test(self):
        return False

    def Cancel(self):
        self.cancelled += 1

    def Wait(self):
        return True


class PollingComm:
    """An MPI-like communicator (no wait_all of its own): p2p polls Test."""

    def Get_rank(self):
        return 0


class Blamed(Exception):
    pass


def test_wait_all_polls_until_the_deadline_names_the_silent_ranks_and_cancels_receives():
    receive, send = Pending(), Pending()
    start = time.perf_counter()
    with pytest.raises(p2p.CollectiveTimeout, match=r"stage 3: rank 0 has not heard from ranks 1, 2 within 0.2 s") as e:
        p2p.wait_all(PollingComm(), [receive, send], [1, 2], "stage 3", receives=1, timeout=0.2)
    assert 0.2 <= time.perf_counter() - start < 5
    assert e.value.missing == [1, 2] and e.value.rank == 0
    assert receive.cancelled == 1 and send.cancelled == 0  # a late message cannot land in a later call


def test_wait_all_raises_what_blame_returns():
    seen = []

    def blame(pending):
        seen.append(pending)
        return Blamed("worker 4 is silent")

    with pytest.raises(Blamed, match="worker 4"):
        p2p.wait_all(PollingComm(), [Pending(), Pending()], [None, 3], "ps", receives=1, timeout=0.05, blame=blame)
    assert seen == [[0, 1]]


def test_test_all_raises_once_pending_past_the_deadline():
    comm, requests = PollingComm(), [Pending()]
    assert not p2p.test_all(comm, requests, [5], "x", receives=1, since=time.perf_counter(), timeout=10)
    with pytest.raises(p2p.CollectiveTimeout, match="rank 5"):
        p2p.test_all(comm, requests, [5], "x", receives=1, since=time.perf_counter() - 11, timeout=10)


def test_on_the_sim_a_deadlock_is_still_a_deadlock_without_blame():
    def job(comm):
        buf = np.empty(2)
        p2p.wait_all(comm, *p2p.post_recv(comm, buf, 1 - comm.Get_rank(), 5)[:2], "x", receives=1)

    with pytest.raises(sim.DeadlockError, match="rank 0 -> rank 1 -> rank 0|rank 1 -> rank 0 -> rank 1"):
        sim.World(2, timeout=20).run(job)


def test_on_the_sim_a_deadlock_ends_the_earliest_blamed_wait_first():
    """Both ranks wait for a message nobody sends, with deadlines of 100 s and 200 s and a
    blame: instead of DeadlockError, the earliest deadline (rank 1's) expires at once, since
    nothing could arrive before it; rank 0 is then stopped (RankAborted)."""
    def job(comm):
        rank, buf = comm.Get_rank(), np.empty(2)
        requests, peers, receives = p2p.post_recv(comm, buf, 1 - rank, 5)
        p2p.wait_all(comm, requests, peers, "x", receives=receives, timeout=200 - 100 * rank,
                     blame=lambda pending: Blamed(f"rank {rank} blames rank {1 - rank}"))

    world = sim.World(2, timeout=20)
    start = time.perf_counter()
    with pytest.raises(Blamed, match="rank 1 blames rank 0"):
        world.run(job)
    assert time.perf_counter() - start < 10 and isinstance(world.errors[0], sim.RankAborted)


# -- the pipeline executor waits with p2p ----------------------------------------------


class Stall(nn.Module):
    """A stage whose forward does not return until ``event`` is set (a neighbour that went
    silent: it computes, it does not wait, so the sim sees no deadlock)."""

    def __init__(self, event):
        super().__init__()
        self.event = event

    def forward(self, x):
        self.event.wait(30)
        return x


def test_a_pipeline_stage_whose_neighbour_is_silent_gets_p2ps_timeout_naming_it():
    """Stage 0 waits for stage 1's gradient; stage 1 never sends it. The stage has no timeout
    of its own, so p2p's deadline applies (0.5 s here, set with p2p.set_timeout): the error is
    a CollectiveTimeout (and a PipelineError) naming rank 1, well before the sim's 20 s."""
    stop = threading.Event()
    x, y = np.random.default_rng(0).normal(size=(4, 3)), np.array([0, 1, 2, 0])

    def job(comm):
        rank = comm.Get_rank()
        part = nn.Sequential(nn.Linear(3, 3, rng=1, dtype="float64")) if rank == 0 else Stall(stop)
        schedule = E.ScheduleGPipe(E.PipelineStage(part, rank, 2, comm), 2, cross_entropy)
        try:
            return schedule.step(x) if rank == 0 else schedule.step(target=y)
        finally:
            stop.set()

    previous = p2p.set_timeout(0.5)
    start = time.perf_counter()
    try:
        with pytest.raises(E.PipelineTimeout, match="stage 0 waiting for micro-batch 0's gradient: rank 0 has not "
                                                    "heard from rank 1 within 0.5 s") as error:
            sim.World(2, timeout=20).run(job)
    finally:
        p2p.set_timeout(previous)
    assert isinstance(error.value, p2p.CollectiveTimeout) and isinstance(error.value, E.PipelineError)
    assert error.value.missing == [1] and error.value.rank == 0
    assert time.perf_counter() - start < 10


# -- one message layer: no private name crosses these modules -------------------------

MODULES = ["minidist/p2p.py", "minidist/collectives.py", "minidist/async_collectives.py", "minidist/costmodel.py",
           "minidist/parallel/pipeline/executor.py", "minidist/parallel/parameter_server/protocol.py",
           "minidist/parallel/parameter_server/server.py", "minidist/parallel/parameter_server/worker.py",
           "minidist/parallel/data_parallel/comm_hooks.py", *sorted(
               str(p.relative_to(ROOT)) for p in (ROOT / "minidist" / "sim").glob("*.py"))]


def private_crossings(path):
    """``from minidist... import _x`` and ``module._x`` for an imported minidist module."""
    tree = ast.parse((ROOT / path).read_text())
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minidist"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{path}: from {node.module} import {alias.name}")
                else:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name.startswith("minidist"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"{path}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_private_name_crosses_the_message_layers_modules():
    assert [found for path in MODULES for found in private_crossings(path)] == []


def test_costmodel_owns_the_algorithm_names_and_imports_nothing_from_collectives():
    from minidist import collectives, costmodel

    tree = ast.parse((ROOT / "minidist" / "costmodel.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any("collectives" in (m or "") for m in imported)
    assert collectives.ALL_REDUCE_ALGORITHMS is costmodel.ALL_REDUCE_ALGORITHMS
    top = ast.parse((ROOT / "minidist" / "collectives.py").read_text()).body
    assert any(isinstance(n, ast.ImportFrom) and n.module == "minidist.costmodel" for n in top)


def test_collectives_reexports_none_of_p2ps_names():
    from minidist import collectives

    for name in ("agree", "set_timeout", "get_timeout", "wait_all", "CollectiveError", "CollectiveTimeout",
                 "stage_to_host", "cuda_aware"):
        assert name not in vars(collectives).get("__all__", ()), name
    tree = ast.parse((ROOT / "minidist" / "collectives.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "minidist.p2p"
                for a in n.names}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert imported <= used, f"imported from p2p but unused (a re-export): {imported - used}"

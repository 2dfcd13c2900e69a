"""Exercises 03 and 04: the checks in minidist.course.checks.collectives catch wrong algorithms (not
only wrong answers), the solutions pass them on the sim and under real mpiexec, the
generated exercise scripts fail, and each solution notebook holds the same functions as its
script (a learner copies them from one to the other)."""
import inspect
import linecache
import runpy
from pathlib import Path

import nbformat
import numpy as np
import pytest
from mpitools import mpiexec_or_skip

from minidist import collectives, sim
from minidist.course import exercises, runner
from minidist.course.checks import DEADLOCK_HINT, LearnerError
from minidist.course.checks import collectives as cc
from minidist.tracing import CountingComm

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = {"03_collectives": ("broadcast", "gather", "all_gather"), "04_ring_allreduce": ("ring_all_reduce",)}


def solution(name):
    """The solution script's functions (its main() is not run: MPI is imported inside it)."""
    return runpy.run_path(str(ROOT / "solutions" / f"{name}.py"))


def verdicts(check, fn, p):
    results = sim.run(lambda comm: check(comm, fn), p)
    assert len(set(results)) == 1, "every rank returns the same verdict"
    return results[0]


# -- the solutions pass, on the sim ---------------------------------------------------------

@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8])
def test_solution_functions_pass_every_check_on_the_sim(p):
    s03, s04 = solution("03_collectives"), solution("04_ring_allreduce")
    assert verdicts(cc.check_broadcast, s03["broadcast"], p).startswith("broadcast: ok")
    assert verdicts(cc.check_gather, s03["gather"], p).startswith("gather: ok")
    assert verdicts(cc.check_all_gather, s03["all_gather"], p).startswith("all_gather: ok")
    assert verdicts(cc.check_ring_all_reduce, s04["ring_all_reduce"], p).startswith("ring all-reduce: ok")


def test_the_engine_collectives_pass_the_same_checks():
    """The answer key, minidist.collectives (validate=False: its argument check uses a
    lowercase allgather, which the counting communicator refuses)."""
    for p in (2, 5, 8):
        world = sim.World(p)
        assert world.run(lambda comm: cc.check_ring_all_reduce(
            comm, lambda c, x: collectives.all_reduce(c, x, algorithm="ring", validate=False)))[0].startswith("ring")
        assert world.run(lambda comm: cc.check_broadcast(
            comm, lambda c, x, root: collectives.broadcast(c, x, root=root, validate=False)))[0].startswith("broadcast")
        assert world.run(lambda comm: cc.check_all_gather(
            comm, lambda c, x: collectives.all_gather(c, x, validate=False)))[0].startswith("all_gather")


# -- wrong algorithms fail, with the right hint ---------------------------------------------

def linear_broadcast(comm, x, root=0):
    return collectives.broadcast(comm, x, root=root, algorithm="linear", validate=False)


def small_subtree_first_broadcast(comm, x, root=0):
    """The binomial tree's edges with every rank serving its nearest child first: for p = 4
    the root sends to 1, then to 2, and 2 forwards to 3 only in a third round."""
    rank, p = comm.Get_rank(), comm.Get_size()
    vr = (rank - root) % p
    out = x.copy() if rank == root else np.empty_like(x)
    lowbit = vr & -vr if vr else 1 << (p - 1).bit_length()
    if vr:
        comm.Recv(out, source=(rank - lowbit) % p)
    mask = 1
    while mask < lowbit:
        if vr + mask < p:
            comm.Send(out, dest=(rank + mask) % p)
        mask <<= 1
    return out


def chain_broadcast(comm, x, root=0):
    rank, p = comm.Get_rank(), comm.Get_size()
    vr = (rank - root) % p
    out = x.copy() if rank == root else np.empty_like(x)
    if vr:
        comm.Recv(out, source=(rank - 1) % p)
    if vr + 1 < p:
        comm.Send(out, dest=(rank + 1) % p)
    return out


def in_place_broadcast(comm, x, root=0):
    """Right values, but it overwrites the caller's x with them."""
    y = solution("03_collectives")["broadcast"](comm, x, root)
    x[...] = y
    return y


def lowercase_gather(comm, x, root=0):
    if comm.Get_rank() != root:
        comm.send(x, dest=root)
        return None
    return np.stack([x if r == root else comm.recv(source=r) for r in range(comm.Get_size())])


def gather_everywhere(comm, x, root=0):
    stacked = solution("03_collectives")["gather"](comm, x, root)
    return stacked if stacked is not None else np.zeros((comm.Get_size(),) + x.shape)


def gather_then_broadcast(comm, x):
    s03 = solution("03_collectives")
    stacked = s03["gather"](comm, x, 0)
    if stacked is None:
        stacked = np.empty((comm.Get_size(),) + x.shape)
    return s03["broadcast"](comm, stacked, 0)


def whole_tensor_ring(comm, x):
    """Right sum, whole tensors passed round the ring twice: 2(p-1) n elements per rank."""
    rank, p = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % p, (rank - 1) % p
    passing, incoming, total = x.astype(float), np.empty(x.shape), x.astype(float)
    for _ in range(p - 1):
        comm.Sendrecv(passing, dest=right, recvbuf=incoming, source=left)
        passing = incoming.copy()
        total += incoming
    for _ in range(p - 1):
        comm.Sendrecv(total, dest=right, recvbuf=incoming, source=left)
    return total


def naive_all_reduce(comm, x):
    return collectives.all_reduce(comm, x, algorithm="naive", validate=False)


def tree_all_reduce(comm, x):
    return collectives.all_reduce(comm, x, algorithm="tree", validate=False)


# The solution's ring with each Sendrecv split into a Send, then a Recv: every rank sends first.
# MPI may buffer a small Send, so this works on small arrays and hangs past the eager limit.
SEND_THEN_RECV_RING = """def ring_all_reduce(comm, x):
    rank, p = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % p, (rank - 1) % p
    flat = np.array(x, copy=True).reshape(-1)
    chunks = np.array_split(flat, p)
    for s in range(p - 1):  # reduce-scatter
        incoming = np.empty_like(chunks[(rank - s - 2) % p])
        comm.Send(chunks[(rank - s - 1) % p], dest=right)
        comm.Recv(incoming, source=left)
        chunks[(rank - s - 2) % p] += incoming
    for s in range(p - 1):  # all-gather
        comm.Send(chunks[(rank - s) % p], dest=right)
        comm.Recv(chunks[(rank - s - 1) % p], source=left)
    return flat.reshape(x.shape)
"""


def send_then_recv_ring(comm, x):
    """SEND_THEN_RECV_RING run as a notebook cell is: compiled under a name of its own, its
    lines in linecache (as IPython does), so tracebacks can quote them."""
    filename = "<cell send_then_recv_ring>"
    linecache.cache[filename] = (len(SEND_THEN_RECV_RING), None, SEND_THEN_RECV_RING.splitlines(True), filename)
    namespace = {"np": np}
    exec(compile(SEND_THEN_RECV_RING, filename, "exec"), namespace)
    return namespace["ring_all_reduce"](comm, x)


def float64_ring(comm, x):
    """The solution's ring on a float64 copy: right sums, wrong dtype for float32 and int64."""
    return solution("04_ring_allreduce")["ring_all_reduce"](comm, x.astype(np.float64))


def float64_all_gather(comm, x):
    rank, p = comm.Get_rank(), comm.Get_size()
    out = np.empty((p,) + x.shape)  # float64, whatever x is
    out[rank] = x
    for s in range(p - 1):
        comm.Sendrecv(out[(rank - s) % p], dest=(rank + 1) % p, recvbuf=out[(rank - s - 1) % p], source=(rank - 1) % p)
    return out


def fails_on_rank_2(comm, x):
    """The solution's ring, but rank 2 indexes past its chunks (the other ranks wait for it)."""
    if comm.Get_rank() == 2:
        return np.array_split(x, comm.Get_size())[comm.Get_size()]
    return solution("04_ring_allreduce")["ring_all_reduce"](comm, x)


def stub_ring(comm, x):
    # YOUR CODE HERE
    raise NotImplementedError()


def bcast_cheat(comm, x, root=0):
    y = x.copy()
    comm.Bcast(y, root=root)
    return y


@pytest.mark.parametrize("check, fn, p, message", [
    (cc.check_broadcast, linear_broadcast, 4, "the root sent 3 messages: that is a linear broadcast"),
    (cc.check_broadcast, small_subtree_first_broadcast, 4, "takes 3 rounds, a binomial tree takes 2"),
    (cc.check_broadcast, chain_broadcast, 4, "takes 3 rounds, a binomial tree takes 2"),
    (cc.check_broadcast, in_place_broadcast, 4, "changed its input x"),
    (cc.check_gather, lowercase_gather, 3, "lowercase send"),
    (cc.check_gather, gather_everywhere, 3, "expected None on this rank"),
    (cc.check_all_gather, gather_then_broadcast, 4, "a ring needs p - 1 = 3"),
    (cc.check_ring_all_reduce, whole_tensor_ring, 4, "whole tensors of 1000 elements went round the ring"),
    (cc.check_ring_all_reduce, whole_tensor_ring, 2, "whole tensors"),
    (cc.check_ring_all_reduce, naive_all_reduce, 4, r"rank 0 sent 3 messages, a ring all-reduce needs 2\(p-1\) = 6"),
    (cc.check_ring_all_reduce, tree_all_reduce, 4, "rank 0 sent 2 messages"),
])
def test_a_wrong_algorithm_fails_even_with_the_right_answer(check, fn, p, message):
    with pytest.raises(AssertionError, match=message) as failure:
        sim.run(lambda comm: check(comm, fn), p)
    assert "\nHint: " in str(failure.value)


@pytest.mark.parametrize("p", [2, 4])
def test_the_send_then_recv_ring_is_a_deadlock_with_the_hint_and_the_learners_line(p):
    """On the sim the check's synchronous sends turn the ring into a DeadlockError at once,
    which the check reports as the hint, the learner's line and the wait-for cycle; nothing
    of the sim's internals is chained to it (the old check passed this ring)."""
    with pytest.raises(AssertionError) as failure:
        sim.run(lambda comm: cc.check_ring_all_reduce(comm, send_then_recv_ring), p)
    message = str(failure.value)
    assert isinstance(failure.value, LearnerError)
    assert message.startswith("ring all-reduce, shape (1000,): deadlock: every rank waits and none can proceed "
                              "(wait-for cycle: rank 0 -> rank 1")
    assert f"\nHint: {DEADLOCK_HINT}\nyour line 8 in ring_all_reduce: comm.Send(chunks[(rank - s - 1) % p], " \
           "dest=right)" in message
    assert "sim.py" not in message and "Traceback" not in message
    assert failure.value.__cause__ is None and failure.value.__suppress_context__


def test_an_error_on_one_rank_names_it_and_the_learners_line():
    with pytest.raises(AssertionError) as failure:
        sim.run(lambda comm: cc.check_ring_all_reduce(comm, fails_on_rank_2), 4)
    assert isinstance(failure.value, LearnerError) and failure.value.rank == 2
    assert str(failure.value).startswith("ring all-reduce, shape (1000,): your fails_on_rank_2 raised IndexError: "
                                         "list index out of range\nHint: ")
    assert "\nyour line " in str(failure.value) and "in fails_on_rank_2: return np.array_split(" in str(failure.value)


def test_an_untouched_stub_says_so_with_its_line():
    with pytest.raises(AssertionError) as failure:
        sim.run(lambda comm: cc.check_ring_all_reduce(comm, stub_ring), 3)
    assert str(failure.value).startswith("ring all-reduce, shape (1000,): this is still a stub: replace "
                                         "`# YOUR CODE HERE` and `raise NotImplementedError()` with your code\n"
                                         "your line ")
    assert str(failure.value).endswith("in stub_ring: raise NotImplementedError()")


@pytest.mark.parametrize("check, fn, cases, message", [
    (cc.check_ring_all_reduce, float64_ring, cc.RING_CASES, r"shape \(3, 7\) int64: expected dtype int64 \(the dtype "
                                                            r"of x\), got float64"),
    (cc.check_ring_all_reduce, float64_ring, (((1000,), "float32"),), "expected dtype float32"),
    (cc.check_all_gather, float64_all_gather, cc.CASES, r"all_gather, shape \(3, 5\) int64: expected dtype int64"),
])
def test_a_result_in_another_dtype_fails(check, fn, cases, message):
    with pytest.raises(AssertionError, match=message) as failure:
        sim.run(lambda comm: check(comm, fn, cases=cases), 3)
    assert "Hint: keep x's dtype" in str(failure.value)


def test_every_check_runs_float32_int64_and_an_array_past_the_eager_limit():
    for cases in (cc.CASES, cc.RING_CASES):
        dtypes = {dtype for _, dtype in cases}
        assert {"float32", "int64"} <= dtypes
        assert max(np.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in cases) >= 1 << 20
    seen = []
    cc.check_all_gather(sim.Comm(sim.World(1), 0), lambda comm, x: seen.append((x.shape, x.dtype)) or x[None].copy())
    assert seen == [((1000,), np.float64), ((3, 5), np.int64), ((1 << 18,), np.float32)]


def test_mpi_collectives_are_refused_by_the_counting_comm():
    with pytest.raises(AssertionError, match="MPI's own collective") as failure:
        sim.run(lambda comm: cc.check_broadcast(comm, bcast_cheat), 2)
    assert "your line" in str(failure.value) and "comm.Bcast(y, root=root)" in str(failure.value)


def test_counting_comm_counts_sends_of_every_kind():
    def job(comm):
        counted = CountingComm(comm)
        rank = comm.Get_rank()
        if rank == 0:
            counted.Send(np.zeros(3), dest=1)
            counted.Isend([np.zeros(5, np.float32), None], dest=1).Wait()
            counted.send({"meta": 1}, dest=1)
        else:
            counted.Recv(np.empty(3), source=0)
            counted.Recv(np.empty(5, np.float32), source=0)
            counted.recv(source=0)
        buf = np.empty(2)
        counted.Sendrecv(np.ones(2), dest=1 - rank, recvbuf=buf, source=1 - rank)
        return counted.messages, counted.elements, counted.nbytes, counted.destinations, counted.object_messages

    assert sim.run(job, 2) == [(3, 10, 24 + 20 + 16, [1, 1, 1], 1), (1, 2, 16, [0], 0)]


def test_ring_element_bounds_match_array_split():
    for n in (0, 1, 3, 10, 1000, 1001):
        for p in (1, 2, 3, 4, 7):
            sizes = [len(c) for c in np.array_split(np.arange(n), p)]
            sent = [2 * n - sizes[r] - sizes[(r + 1) % p] for r in range(p)] if p > 1 else [0]
            low, high = cc.ring_elements_bounds(n, p)
            assert all(low <= s <= high for s in sent), (n, p)


# -- the notebook and the script hold the same functions ------------------------------------


@pytest.mark.parametrize("name", sorted(CHAPTERS))
def test_solution_notebook_and_script_hold_the_same_solution_code(name):
    script = exercises.solution_regions((ROOT / "solutions" / f"{name}.py").read_text())
    nb = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
    notebook = [region for cell in nb.cells if cell.cell_type == "code"
                for region in exercises.solution_regions(cell.source)]
    assert len(script) == len(CHAPTERS[name])
    assert notebook == script, f"the solution code differs between {name}.ipynb and {name}.py"


# -- under real mpiexec ----------------------------------------------------------------------

def run_script(path, n=4, timeout=120, cwd=None):
    from minidist.launch import launch

    mpiexec_or_skip()
    return launch(path, n, timeout=timeout, mpiexec=None, cwd=cwd)


@pytest.mark.mpi
@pytest.mark.parametrize("name, lines", [
    ("03_collectives", ["broadcast: ok (binomial tree on 4 ranks: 3 messages in 2 rounds",
                        "gather: ok (3 messages", "all_gather: ok (ring on 4 ranks",
                        "03_collectives: all checks pass on 4 ranks"]),
    ("04_ring_allreduce", ["ring all-reduce: ok (4 ranks, n = 1000: each rank sent 6 messages and 1500 elements",
                           "04_ring_allreduce: all checks pass on 4 ranks"]),
])
def test_solution_script_passes_under_mpiexec_and_exercise_script_fails(name, lines, tmp_path):
    result = run_script(ROOT / "solutions" / f"{name}.py")
    assert result.returncode == 0, result.stderr
    for line in lines:
        assert line in result.stdout
    # The exercise as generated now (exercises/ may hold a learner's work).
    (tmp_path / f"{name}.py").write_text(exercises.render_exercise(ROOT / "solutions" / f"{name}.py"))
    exercise = run_script(tmp_path / f"{name}.py")
    assert exercise.returncode != 0
    assert ": this is still a stub: replace `# YOUR CODE HERE`" in exercise.stderr
    assert "your line " in exercise.stderr and ": raise NotImplementedError()" in exercise.stderr


@pytest.mark.mpi
def test_a_wrong_ring_fails_under_mpiexec_with_its_hint_and_no_hang(tmp_path):
    """The solution script's main() with the whole-tensor ring swapped in: every rank must
    fail with the same verdict (no rank left waiting), reported once, exit status 1."""
    script = tmp_path / "wrong_ring.py"
    script.write_text("\n".join([
        "import inspect, runpy, sys",
        "import numpy as np",
        inspect.getsource(whole_tensor_ring),
        f"main = runpy.run_path({str(ROOT / 'solutions' / '04_ring_allreduce.py')!r})['main']",
        "main.__globals__['ring_all_reduce'] = whole_tensor_ring",
        "sys.exit(main())", ""]))
    result = run_script(script, timeout=120)
    assert result.returncode != 0
    assert "AssertionError: ring all-reduce, shape (1000,): rank 0 sent 6000 elements" in result.stderr
    assert "Hint: cut x into p chunks" in result.stderr
    assert result.stderr.count("AssertionError") == 1


@pytest.mark.mpi
def test_the_send_then_recv_ring_fails_check_04_under_mpiexec_with_the_deadlock_hint(tmp_path, capsys):
    """The solution script with the Send-then-Recv ring: under mpiexec it hangs (synchronous
    sends; 1 MiB is past MPICH's eager limit anyway), and check 04 reports the timeout with the
    hint. The old check passed this ring (its messages were small enough to be buffered)."""
    mpiexec_or_skip()
    source = (ROOT / "solutions" / "04_ring_allreduce.py").read_text()
    start, end = source.index("def ring_all_reduce("), source.index("def main(")
    (tmp_path / "04_ring_allreduce.py").write_text(source[:start] + SEND_THEN_RECV_RING + "\n\n" + source[end:])
    assert runner.run_check("04", timeout=15.0, ranks=4, exercises=tmp_path) == 1
    out = capsys.readouterr().out
    assert "timed out after 15 s: the ranks wait for each other (a deadlock?)" in out
    assert f"Hint: {DEADLOCK_HINT}" in out


@pytest.mark.slow
@pytest.mark.mpi
def test_the_send_then_recv_ring_fails_check_04_on_the_sim(tmp_path, capsys):
    """The issue's 'done when': the solution notebook with the Send-then-Recv ring is a
    DeadlockError on the sim and fails `check 04` (its script is the solution's, so the
    notebook's mpiexec cell passes and the failure is the sim's)."""
    mpiexec_or_skip()
    nb = nbformat.read(ROOT / "solutions" / "04_ring_allreduce.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith("def ring_all_reduce(")]
    cell.source = SEND_THEN_RECV_RING
    nbformat.write(nb, tmp_path / "04_ring_allreduce.ipynb")
    (tmp_path / "04_ring_allreduce.py").write_text((ROOT / "solutions" / "04_ring_allreduce.py").read_text())
    assert runner.run_check("04", timeout=60.0, ranks=4, exercises=tmp_path) == 1
    out = capsys.readouterr().out
    assert "04_ring_allreduce.ipynb: 5 of 6 cells pass\n  ✘ cell 8 (print(sim.run(lambda comm: ring_all_reduce(" in out
    assert "deadlock: every rank waits and none can proceed (wait-for cycle: rank 0 -> rank 1" in out
    assert f"Hint: {DEADLOCK_HINT}" in out
    assert "your line 8 in ring_all_reduce: comm.Send(chunks[(rank - s - 1) % p], dest=right)" in out
    assert out.rstrip().endswith("exercise 04: 6 of 7 checks pass (not yet)")


@pytest.mark.mpi
def test_an_error_on_one_rank_under_mpiexec_is_reported_by_that_rank_without_a_hang(tmp_path):
    """Rank 2's LearnerError is printed by rank 2 (rank 0 is waiting for it, in the ring),
    which exits 1 and so ends the job: no hang, the message and the learner's line in stderr."""
    script = tmp_path / "fails_on_rank_2.py"
    script.write_text("\n".join([
        "import runpy, sys",
        "import numpy as np",
        f"solution = runpy.run_path({str(ROOT / 'solutions' / '04_ring_allreduce.py')!r})",
        inspect.getsource(fails_on_rank_2),
        "main = solution['main']",
        "main.__globals__['ring_all_reduce'] = fails_on_rank_2",
        "sys.exit(main())", ""]))
    result = run_script(script, timeout=60)
    assert result.returncode != 0
    assert "AssertionError: ring all-reduce, shape (1000,): your fails_on_rank_2 raised IndexError" in result.stderr
    assert "in fails_on_rank_2: return np.array_split(" in result.stderr


# -- exercise 16's mpirun script: the mesh's groups on MPI's own Comm.Split ---------------------


def test_exercise_16s_notebook_and_script_hold_the_same_build_groups():
    script = exercises.solution_regions((ROOT / "solutions" / "16_3d_parallelism.py").read_text())
    nb = nbformat.read(ROOT / "solutions" / "16_3d_parallelism.ipynb", as_version=4)
    notebook = [region for cell in nb.cells if cell.cell_type == "code" for region in
                exercises.solution_regions(cell.source) if "def build_groups" in cell.source]
    assert len(script) == 1 and notebook == script


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,shapes", [(8, 10), (4, 6)])
def test_exercise_16_runs_under_real_mpiexec(ranks, shapes, tmp_path):
    """Issue 36, item 2: an exercise of chapters 13-18 under real mpiexec. The solution passes on
    every (dp, pp, tp) shape of the job's ranks; the generated script fails at its stub; a
    column-major numbering fails on every rank with the tp-outermost hint, reported once."""
    result = run_script(ROOT / "solutions" / "16_3d_parallelism.py", n=ranks)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(f"on {ranks} MPI ranks: groups of") == shapes
    assert f"16_3d_parallelism: all checks pass on {ranks} ranks" in result.stdout
    (tmp_path / "16_3d_parallelism.py").write_text(exercises.render_exercise(ROOT / "solutions" /
                                                                           "16_3d_parallelism.py"))
    exercise = run_script(tmp_path / "16_3d_parallelism.py", n=ranks)
    assert exercise.returncode != 0 and ": this is still a stub: replace `# YOUR CODE HERE`" in exercise.stderr
    wrong = (ROOT / "solutions" / "16_3d_parallelism.py").read_text().replace(
        "np.unravel_index(comm.Get_rank(), shape)", 'np.unravel_index(comm.Get_rank(), shape, order="F")')
    (tmp_path / "wrong.py").write_text(wrong)
    failed = run_script(tmp_path / "wrong.py", n=ranks)
    assert failed.returncode != 0 and failed.stderr.count("AssertionError: ") == 1, failed.stderr
    assert "Yours puts tp outermost" in failed.stderr


@pytest.mark.mpi
def test_check_16_grades_the_notebook_and_the_mpirun_script(tmp_path, capsys):
    """``check 16`` runs both parts: the solutions (copied as a learner's finished work) pass."""
    mpiexec_or_skip()
    folder = tmp_path / "exercises"
    folder.mkdir()
    for name in ("16_3d_parallelism.ipynb", "16_3d_parallelism.py"):
        (folder / name).write_text((ROOT / "solutions" / name).read_text())
    assert runner.run_check("16", exercises=folder, ranks=4, timeout=240.0, solutions=ROOT / "solutions") == 0
    assert "16_3d_parallelism.py under mpiexec -n 4: passes" in capsys.readouterr().out

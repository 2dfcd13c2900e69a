"""minidist.launch: finding mpiexec, running scripts under it, crashes, timeouts, doctor."""
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
from mpitools import mpi_missing

from minidist import cli, launch

SCRIPT = Path(__file__).parent / "mpi" / "crash_and_hang.py"


# -- without MPI ---------------------------------------------------------------------------

def test_missing_mpiexec_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)
    with pytest.raises(launch.LaunchError, match="pip install mpi4py mpich"):
        launch.find_mpiexec()


def test_missing_mpi4py_names_the_fix(monkeypatch):
    monkeypatch.setattr(launch, "_has_module", lambda name: False)
    with pytest.raises(launch.LaunchError, match="mpi4py is not installed.*pip install mpi4py mpich"):
        launch.launch(SCRIPT, 2)


def fake_mpiexec(tmp_path, banner):
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\necho '{banner}'\n")
    path.chmod(0o755)
    launch.mpi_flavor.cache_clear()
    return str(path)


def test_open_mpi_gets_root_and_oversubscribe_flags(tmp_path):
    command = launch.mpiexec_command("s.py", 3, ["--x", 1], fake_mpiexec(tmp_path, "mpiexec (Open MPI) 5.0.3"))
    assert command[1:5] == ["-n", "3", "--allow-run-as-root", "--oversubscribe"]
    assert command[5:] == [sys.executable, "-m", "mpi4py", "s.py", "--x", "1"]


def test_mpich_gets_no_extra_flags(tmp_path):
    command = launch.mpiexec_command("s.py", 2, mpiexec=fake_mpiexec(tmp_path, "HYDRA build details:"))
    assert command[1:] == ["-n", "2", sys.executable, "-m", "mpi4py", "s.py"]


@pytest.mark.parametrize("env,world", [
    ({}, None),
    ({"PMI_RANK": "2", "PMI_SIZE": "4"}, (2, 4)),  # MPICH's hydra
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"}, (1, 3)),  # Open MPI
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, (5, 8)),  # srun, no PMI_* of its own
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (0, 2)),  # mpiexec in an sbatch
    ({"PMI_RANK": "x", "PMI_SIZE": "2"}, None),  # unreadable: as if not set
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2"}, None),  # a rank outside the world
])
def test_the_rank_before_mpi_starts_comes_from_the_launchers_variables(monkeypatch, env, world):
    for rank_name, size_name in launch.WORLD_VARIABLES:
        monkeypatch.delenv(rank_name, raising=False)
        monkeypatch.delenv(size_name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launch.world_from_env() == world


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive integer"):
        launch.mpiexec_command("s.py", 0, mpiexec="mpiexec")
    with pytest.raises(FileNotFoundError):
        launch.launch("no/such/script.py", 2)


def test_doctor_rejects_unknown_flags(capsys):
    assert cli.main(["doctor", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--timeout", "nan"], "argument --timeout: must be a finite number > 0, got nan"),
    (["--timeout", "0"], "argument --timeout: must be a finite number > 0, got 0"),
    (["--timeout", "-5"], "argument --timeout: must be a finite number > 0, got -5"),
    (["--ranks", "0"], "argument -n/--ranks: must be a positive integer, got 0"),
])
def test_doctor_bad_values_are_usage_errors(args, message, capsys, monkeypatch):
    monkeypatch.setattr(launch, "doctor", lambda *a, **k: pytest.fail("doctor ran with a bad flag"))
    assert cli.main(["doctor", *args]) == 2
    assert message in capsys.readouterr().err


def test_one_mpi4py_check_names_the_fix_and_what_needs_it(monkeypatch):
    monkeypatch.setattr(launch, "_has_module", lambda name: False)
    with pytest.raises(launch.LaunchError, match=r"mpi4py is not installed .*\(--strategy ddp needs it\): pip install"):
        launch.require_mpi4py("--strategy ddp", load=True)


def test_doctor_without_mpi_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(launch, "_has_module", lambda name: name not in ("mpi4py", "cupy"))
    assert launch.doctor() == 1
    out = capsys.readouterr().out
    assert "mpi4py    not installed" in out and "NOT READY" in out and "pip install mpi4py mpich" in out


# -- with MPI ------------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.skipif(mpi_missing() is not None, reason=f"no MPI: {mpi_missing()}")
def test_launch_runs_every_rank_with_args_and_env():
    result = launch.launch(SCRIPT, 3, timeout=60, args=["echo", "a b", 7], env={"MINIDIST_TEST": "yes"}).check()
    # Ranks write concurrently, so one rank's line may be cut by another's: match, don't split.
    found = sorted(re.findall(r"rank \d of 3 args=\['a b', '7'\] env=yes", result.stdout))
    assert found == [f"rank {r} of 3 args=['a b', '7'] env=yes" for r in range(3)]


@pytest.mark.mpi
@pytest.mark.skipif(mpi_missing() is not None, reason=f"no MPI: {mpi_missing()}")
def test_a_crash_on_one_rank_ends_the_job():
    start = time.perf_counter()
    result = launch.launch(SCRIPT, 3, timeout=60, args=["crash"])
    assert time.perf_counter() - start < 30  # aborted, not timed out
    assert not result.ok
    assert "rank 1 crashed on purpose" in result.stderr
    with pytest.raises(launch.LaunchError, match="exited with status"):
        result.check()


@pytest.mark.mpi
@pytest.mark.skipif(mpi_missing() is not None, reason=f"no MPI: {mpi_missing()}")
def test_a_timeout_kills_every_rank(tmp_path):
    marker = tmp_path / "pid"
    start = time.perf_counter()
    with pytest.raises(launch.LaunchTimeout, match="timeout of 3 s"):
        launch.launch(SCRIPT, 2, timeout=3, args=["hang", marker])
    assert time.perf_counter() - start < 20
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(2)]
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "a rank survived the timeout"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.mpi
@pytest.mark.skipif(mpi_missing() is not None, reason=f"no MPI: {mpi_missing()}")
def test_doctor_runs_the_smoke_test(capsys, monkeypatch):
    monkeypatch.setenv("MINIDIST_RANKS_PER_NODE", "2")  # fake nodes: the doctor reports them
    monkeypatch.delenv("MINIDIST_CUDA_AWARE_MPI", raising=False)
    assert cli.main(["doctor", "--ranks", "4", "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    for needle in ("numpy", "cupy", "mpi4py", "MPI ", "OK ranks=4", "verdict: OK",
                   "nodes     2 nodes x 2 ranks (fake nodes of MINIDIST_RANKS_PER_NODE ranks, all on this machine)"):
        assert needle in out
    # MPICH >= 4 and Open MPI >= 2 answer MPIX_Query_cuda_support(); the pip wheel is built without CUDA
    assert re.search(r"CUDA MPI  (yes|no) \(MPIX_Query_cuda_support\(\) = [01]\); minidist ", out), out


def test_doctor_describes_nodes_and_cuda_awareness():
    assert launch.describe_nodes("1 4 one node") == "1 node x 4 ranks (every rank on this machine)"
    assert launch.describe_nodes("3 8 host names") == "3 nodes x 8 ranks (by host name: ranks on different machines)"
    assert launch.describe_nodes("uneven node_layout: the nodes hold [3, 1]").startswith("no layout of equal nodes: ")
    assert launch.describe_cuda_aware(None) == ("unknown (this MPI library has no MPIX_Query_cuda_support); "
                                                "minidist copies GPU arrays through host memory")
    assert launch.describe_cuda_aware(True).endswith("(set MINIDIST_CUDA_AWARE_MPI=1 to hand them to MPI)")
    assert launch.describe_cuda_aware(True, "1") == ("yes (MPIX_Query_cuda_support() = 1); minidist hands GPU arrays "
                                                     "to MPI (MINIDIST_CUDA_AWARE_MPI=1)")
    assert launch.describe_cuda_aware(False, "1").endswith("which this library cannot take: unset "
                                                           "MINIDIST_CUDA_AWARE_MPI")


def test_an_interrupted_launch_kills_the_whole_job(tmp_path, monkeypatch):
    # A notebook cell's timeout (KeyboardInterrupt) must not leave mpiexec and its ranks spinning.
    import subprocess

    from minidist import launch

    killed = []

    class CellTimeout(BaseException):  # stands for KeyboardInterrupt, which pytest itself would catch
        pass

    class Interrupted(subprocess.Popen):
        def communicate(self, *args, **kwargs):
            if not killed:
                raise CellTimeout
            return super().communicate(*args, **kwargs)

    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    try:
        launch.mpiexec_command(script, 1)  # finds mpiexec (and its flavour) before Popen is replaced
    except launch.LaunchError:
        pytest.skip("no MPI")
    real_kill = launch._kill
    monkeypatch.setattr(launch, "_kill", lambda proc: (killed.append(proc), real_kill(proc))[1])
    monkeypatch.setattr(launch.subprocess, "Popen", Interrupted)
    with pytest.raises(CellTimeout):
        launch.launch(script, 1, timeout=60)
    assert len(killed) == 1 and killed[0].poll() is not None  # the job is gone


# ----------------------------------------------------------------------------- BLAS threads per rank
def test_each_rank_gets_its_share_of_the_cores(monkeypatch):
    from threadpoolctl import threadpool_limits

    from minidist import sim

    for name in launch.BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    with threadpool_limits(limits=None):  # restores the limits afterwards
        assert sim.run(launch.limit_blas_threads, 1) == [None]  # one rank: nothing to share
        assert sim.run(launch.limit_blas_threads, 4) == [2] * 4  # the sim's ranks share one host
        assert sim.run(launch.limit_blas_threads, 16) == [1] * 16  # never fewer than one
        # (the sim restores BLAS threads after a run: test_train_under_mpiexec_... sees them set)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user chose: left alone
        assert sim.run(launch.limit_blas_threads, 4) == [None] * 4


def test_a_command_runs_with_one_blas_thread_unless_the_user_chose(monkeypatch):
    """Issue 36: `train --model gpt` took 1,525 s on a busy 2-core machine with OpenBLAS's two
    threads and 272 s with OMP_NUM_THREADS=1, bit-identical. Every command now runs with one BLAS
    thread (restored after it); a BLAS_THREAD_VARIABLES setting is the user's choice, left alone."""
    from threadpoolctl import threadpool_info, threadpool_limits

    def blas_threads():
        return sorted({p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"})

    seen = []
    monkeypatch.setattr(cli, "command_function", lambda command: lambda argv: seen.append(blas_threads()) or 0)
    for name in launch.BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with threadpool_limits(limits=2, user_api="blas"):  # as OpenBLAS starts on a 2-core machine
        assert cli.main(["train", "--model", "gpt"]) == 0 and seen == [[1]]
        assert blas_threads() == [2]  # restored after the command
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert cli.main(["generate"]) == 0 and seen == [[1], [2]]


def test_ranks_per_node_come_from_host_names(monkeypatch):
    from minidist import sim

    for name in launch.BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    hosts = {}  # sim rank (thread) -> its "host": ranks 0-2 on node a, rank 3 alone on node b
    monkeypatch.setattr(launch.socket, "gethostname", lambda: hosts[threading.get_ident()])

    def rank(comm):
        hosts[threading.get_ident()] = "a" if comm.Get_rank() < 3 else "b"
        return launch.limit_blas_threads(comm)

    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=None):
        assert sim.run(rank, 4) == [2, 2, 2, 8]


def test_a_rank_that_never_counts_its_node_is_named_not_waited_for_forever():
    # before: comm.Split_type, which has no deadline; here one rank of the sim never comes
    from minidist import p2p, sim

    def rank(comm):
        if comm.Get_rank() == 2:  # busy elsewhere past the deadline (the sim would call a returned rank a deadlock)
            time.sleep(2)
            return None
        try:
            return launch.limit_blas_threads(comm)
        except p2p.CollectiveTimeout as error:
            return error.missing, str(error)

    previous = p2p.set_timeout(0.5)  # once, here: the deadline is the process's, shared by the rank threads
    try:
        results = sim.run(rank, 3)
    finally:
        p2p.set_timeout(previous)
    for missing, message in results[:2]:
        assert missing == [2] and message.startswith("counting the ranks on each node (for BLAS threads)")


def test_finish_ends_a_one_rank_world_untouched():
    from minidist import sim

    assert launch.finish(None, 2, timeout=1.0) == 2
    assert sim.run(lambda comm: launch.finish(comm, 1, timeout=1.0), 1) == [1]


@pytest.mark.mpi
def test_train_under_mpiexec_runs_one_blas_thread_per_core_share(tmp_path, monkeypatch):
    """Under mpiexec with more ranks than cores each rank runs one BLAS thread (with the
    default, every rank started one per core: PipeDream on 4 ranks took 54 s instead of 4 s)."""
    from mpitools import mpiexec_or_skip

    script = tmp_path / "threads.py"
    script.write_text("import os, sys\n"
                      "from mpi4py import MPI\n"
                      "from threadpoolctl import threadpool_info\n"
                      "from minidist import launch\n"
                      "cores = len(os.sched_getaffinity(0))\n"
                      "wanted = launch.limit_blas_threads(MPI.COMM_WORLD)\n"
                      "blas = sorted({p['num_threads'] for p in threadpool_info() if p['user_api'] == 'blas'})\n"
                      "with open(f'{sys.argv[1]}/rank{MPI.COMM_WORLD.Get_rank()}', 'w') as f:\n"
                      "    f.write(f'{cores} {wanted} {blas}')\n")  # a file each: printed lines interleave
    for name in launch.BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    launch.launch(script, 4, timeout=120, args=[tmp_path], mpiexec=mpiexec_or_skip()).check()
    for rank in range(4):
        cores, wanted, blas = (tmp_path / f"rank{rank}").read_text().split(" ", 2)
        assert int(wanted) == max(1, int(cores) // 4) and blas == f"[{wanted}]", (rank, cores, wanted, blas)


@pytest.mark.mpi
def test_a_rank_stopped_before_mpi_init_is_named_by_the_start_up_watchdog(tmp_path):
    """Issue 36, item 4: a rank stopped before the others finish MPI_Init left them spinning in
    PMPI_Init_thread forever, with no message. Under launch's supervisor the attempt is ended
    once the others have waited the deadline in MPI_Init, with one line naming the missing rank,
    and nothing of the job is left."""

    from mpitools import mpiexec_or_skip

    script = ("import os, signal, sys, time\n"
              "from minidist import launch\n"
              "if os.environ['PMI_RANK'] == '2':\n"
              "    open(os.path.join(sys.argv[1], 'pid'), 'w').write(str(os.getpid()))\n"
              "    os.kill(os.getpid(), signal.SIGSTOP)\n"
              "launch.require_mpi4py('the test', load=True)\n"
              "time.sleep(60)\n")
    command = [mpiexec_or_skip(), "-n", "3", sys.executable, "-c", script, str(tmp_path)]
    lines, start = [], time.monotonic()
    status = launch.run_with_restarts(command, command, 0, 120, log=lines.append, startup=3.0)
    assert status == launch.TIMED_OUT and time.monotonic() - start < 60
    assert lines == ["launch: start-up: rank 2 never reached MPI_Init (stopped, or dead before MPI started?) while "
                     "ranks 0, 1 waited for 3 s in it; ended the job"], lines
    assert_gone(tmp_path / "pid")


def assert_gone(pid_file) -> None:
    """The process whose pid ``pid_file`` holds (a rank that stopped itself) is gone, or a zombie."""
    import subprocess

    pid = int(pid_file.read_text())
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    assert state in ("", "Z"), f"the stopped rank ({pid}) is still there: {state}"


class Running:
    """A job that never ends (its ``poll`` says it runs), for the watchdogs' marker tests."""

    def poll(self):
        return None


def watched(watchdog, folder, names, deadline: float):
    """``watchdog`` (launch's start-up or end watchdog) over a job of 3 ranks that never ends,
    after the markers ``names`` were written in ``folder``, with 0.2 s to wait and ``deadline``
    seconds in all: its verdict (None, or the line it says)."""
    for name in names:
        (folder / name).touch()
    return watchdog(Running(), str(folder), 3, 0.2, time.monotonic() + deadline)


def test_the_start_up_watchdog_reads_the_ranks_markers(tmp_path):
    """Every rank out of MPI_Init: nothing to say; one rank never came: it is named; every rank in
    MPI_Init and none out: all named; a command that is not mpiexec is not watched."""
    def watch(*names):
        return watched(launch._watch_startup, tmp_path, names, deadline=5)

    assert watch("rank0.init", "rank1.init") == ("start-up: rank 2 never reached MPI_Init (stopped, or dead before "
                                                 "MPI started?) while ranks 0, 1 waited for 0.2 s in it")
    assert watch("rank2.init") == ("start-up: ranks 0, 1, 2 did not finish MPI_Init within 0.2 s (a rank stopped "
                                   "inside it?)")
    assert watch("rank0.ready", "rank1.ready", "rank2.ready") is None
    assert launch._ranks_of([sys.executable, "-m", "minidist", "train"]) is None
    assert launch._ranks_of(["/x/bin/mpiexec", "-n", "4", sys.executable]) == 4


@pytest.mark.mpi
def test_an_mpmd_job_whose_ranks_run_different_commands_is_one_line_not_a_traceback_or_a_wait():
    """Issue 36, item 4: `mpiexec -n 1 ... evaluate : -n 2 ... train` ran evaluate's rounds against
    train's (an AttributeError traceback here, or a wait). Now the ranks agree on the command first,
    right after MPI_Init: rank 0 names each rank's command and the fix, and the job ends (status 2)."""
    import subprocess

    from mpitools import JOB_ENV, mpiexec_or_skip

    rank = [sys.executable, "-m", "mpi4py", "-m", "minidist"]
    done = subprocess.run([mpiexec_or_skip(), "-n", "1", *rank, "evaluate", ":", "-n", "2", *rank, "train",
                           "--strategy", "ddp", "--epochs", "1", "--timeout", "30"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **JOB_ENV})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert lines == ["minidist evaluate: error: the ranks of this job run different commands (rank 0: evaluate; "
                     "ranks 1, 2: train); every rank of an MPI job runs the same one: start them with one `mpiexec "
                     "-n 3 python -m mpi4py -m minidist COMMAND ...`, not with mpiexec's ':'"], done.stderr


@pytest.mark.mpi
def test_the_command_round_waits_no_longer_than_the_command_s_timeout():
    """The first round (the ranks' commands) has train's --timeout, not the collectives' 300 s: a
    rank that runs no minidist command at all is named within it, in one line."""
    import subprocess

    from mpitools import JOB_ENV, mpiexec_or_skip

    start = time.monotonic()
    done = subprocess.run([mpiexec_or_skip(), "-n", "1", sys.executable, "-m", "mpi4py", "-m", "minidist", "train",
                           "--strategy", "ddp", "--epochs", "1", "--timeout", "3", ":", "-n", "1", sys.executable, "-c",
                           "from mpi4py import MPI; import time; time.sleep(60)"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **JOB_ENV})
    assert done.returncode == 1 and time.monotonic() - start < 40, (done.returncode, done.stderr)
    assert "minidist train: error: start-up: the ranks' commands: rank 0 has not heard from rank 1 within 3 s" \
        in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.mpi
def test_a_rank_stopped_inside_mpi_finalize_is_ended_by_the_watchdog(tmp_path):
    """Issue 36, item 4: a rank stopped inside MPI_Finalize after its run left the job hanging
    (the others wait in MPI_Finalize, mpiexec waits for every rank). Under launch's supervisor
    the end is watched like the start: every rank marks that it enters MPI_Finalize, and the
    attempt is ended once the job has not ended 2 x deadline + FINISH_SLACK seconds after."""

    from mpitools import mpiexec_or_skip

    script = ("import atexit, os, signal, sys\n"
              "from minidist import launch\n"
              "if os.environ['PMI_RANK'] == '1':  # registered first, so it runs after the marker: inside finalize\n"
              "    open(os.path.join(sys.argv[1], 'pid'), 'w').write(str(os.getpid()))\n"
              "    atexit.register(os.kill, os.getpid(), signal.SIGSTOP)\n"
              "MPI = launch.require_mpi4py('the test', load=True)\n"
              "MPI.COMM_WORLD.Barrier()\n")
    command = [mpiexec_or_skip(), "-n", "3", sys.executable, "-c", script, str(tmp_path)]
    lines, start = [], time.monotonic()
    status = launch.run_with_restarts(command, command, 0, 120, log=lines.append, startup=3.0)
    waited = 2 * 3.0 + launch.FINISH_SLACK
    assert status == launch.TIMED_OUT and waited < time.monotonic() - start < waited + 40
    assert lines == [f"launch: end: the job did not end within {waited:g} s after every rank reached MPI_Finalize "
                     "(a rank stopped inside it?); ended the job"], lines
    assert_gone(tmp_path / "pid")


def test_the_end_watchdog_reads_the_ranks_markers(tmp_path):
    """No rank at the end: nothing to say before the deadline; some ranks there and one not:
    the missing one is named; every rank there and the job still running: said so."""
    def watch(*names):
        return watched(launch._watch_finish, tmp_path, names, deadline=1)

    assert watch() is None
    assert watch("rank0.finalize", "rank2.finalize") == ("end: rank 1 never reached MPI_Finalize (stopped or stuck "
                                                         "after the run?) while ranks 0, 2 waited for 0.2 s in it")
    assert watch("rank1.finalize") == ("end: the job did not end within 0.2 s after every rank reached MPI_Finalize "
                                       "(a rank stopped inside it?)")

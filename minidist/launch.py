"""Run a script under ``mpiexec`` from Python or a notebook; ``python -m minidist doctor``; and
``python -m minidist launch``, which relaunches a failed training job from its checkpoints
(:func:`supervise`).

    from minidist.launch import launch
    result = launch("exercises/03_broadcast.py", 4, timeout=60)
    print(result.stdout)          # everything the ranks printed
    result.check()                # raise LaunchError if the job failed

The command is ``mpiexec -n N python -m mpi4py script.py args...``:

- ``python`` is this interpreter (``sys.executable``), so the ranks see the same packages;
- ``-m mpi4py`` makes an uncaught exception on one rank abort the whole job (MPI_Abort)
  instead of leaving the other ranks waiting forever for its messages;
- ``mpiexec`` is the one next to ``sys.executable`` (where ``pip install mpich`` puts it),
  else the first on PATH; with Open MPI we add ``--allow-run-as-root --oversubscribe``
  (MPICH needs neither to run as root or with more ranks than cores);
- a timeout always applies: past it, the whole process group is killed and
  :class:`LaunchTimeout` is raised with what the ranks printed so far.

Inside a job, what a rank of ``train`` or ``evaluate`` does around its work, every wait with
the collectives' deadline: :func:`world_from_env` (its rank before MPI starts, to print a usage
error once), :func:`limit_blas_threads` (its share of the node's cores) and :func:`finish` (a
bounded barrier before MPI finalizes; a missing rank is named and the job aborted).

Longer than 400 lines: the launcher, the restart supervisor and ``doctor`` share the one way this
project finds and runs ``mpiexec`` (its path, Open MPI's flags, the deadline, ending a job and its
ranks); tests patch those helpers in one namespace.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import importlib.util
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from threadpoolctl import threadpool_limits

from minidist.backend import cuda_available
from minidist.p2p import CollectiveTimeout, agree, get_timeout, set_timeout

FIX = "pip install mpi4py mpich"


class LaunchError(RuntimeError):
    """mpiexec or mpi4py is missing, or a launched job failed (see ``LaunchResult.check``)."""


class LaunchTimeout(LaunchError, TimeoutError):
    """The job ran past its timeout and was killed; ``stdout``/``stderr`` hold its output so far."""

    def __init__(self, message, stdout="", stderr=""):
        super().__init__(message)
        self.stdout, self.stderr = stdout, stderr


@dataclass
class LaunchResult:
    """What a launched job did: the command, its exit status, its output, its wall time."""

    args: list
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def check(self) -> LaunchResult:
        """Return self if the job succeeded, else raise LaunchError with the end of its stderr."""
        if not self.ok:
            tail = "\n".join(self.stderr.strip().splitlines()[-15:])
            raise LaunchError(f"{' '.join(self.args)} exited with status {self.returncode}:\n{tail}")
        return self


def find_mpiexec() -> str:
    """The mpiexec next to ``sys.executable``, else the first ``mpiexec``/``mpirun`` on PATH.
    Raises LaunchError naming the fix when there is none."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return found
    raise LaunchError(f"no mpiexec found next to {sys.executable} or on PATH. "
                      f"Install MPI for this Python: {FIX}")


def _has_module(name) -> bool:
    return importlib.util.find_spec(name) is not None


def require_mpi4py(needed_by: str | None = None, *, load: bool = False):
    """The one check for mpi4py: raise LaunchError naming the fix (``pip install mpi4py
    mpich``) when this Python cannot use it.

    ``load=False`` (the launcher, doctor, tests): only checks that the package is
    installed, without starting MPI in this process; returns None. ``load=True`` (a rank
    of a job, e.g. ``train --strategy ddp``): imports ``mpi4py.MPI``, which initialises MPI,
    and returns that module (``require_mpi4py("--strategy ddp", load=True).COMM_WORLD``);
    an MPI library that cannot be loaded is reported too. ``needed_by`` names what needs
    it, for the message."""
    who = f" ({needed_by} needs it)" if needed_by else ""
    if not _has_module("mpi4py"):
        raise LaunchError(f"mpi4py is not installed for {sys.executable}{who}: {FIX}")
    if not load:
        return None
    note_startup("init")  # for launch's start-up watchdog: this rank is about to enter MPI_Init
    try:
        from mpi4py import MPI  # noqa: PLC0415 (importing it starts MPI)
    except ImportError as error:
        raise LaunchError(f"mpi4py is installed but cannot load an MPI library{who} ({error}): {FIX}") from None
    note_startup("ready")  # ... and came out of it
    # Python's exit handlers run last registered first, and mpi4py finalises MPI after them: this rank
    # marks that it is about to enter MPI_Finalize (the watchdog's end of the job, _watch_finish).
    atexit.register(note_startup, "finalize")
    agree_on_command(MPI.COMM_WORLD)
    return MPI


# The command of ``python -m minidist`` this process runs (``cli.main`` sets it, :func:`running`):
# under mpiexec every rank must run the same one, which :func:`agree_on_command` checks first.
_command: str | None = None
_deadline: float | None = None  # its --timeout, when given: the deadline of that first round


@contextlib.contextmanager
def running(command: str, argv: list[str] = ()):
    """Within the block this process runs ``python -m minidist COMMAND ARGV`` (for
    :func:`agree_on_command`, which waits at most ARGV's ``--timeout``, else the collectives' default)."""
    global _command, _deadline
    previous = _command, _deadline
    _command, _deadline = command, _timeout_flag([str(a) for a in argv])
    try:
        yield
    finally:
        _command, _deadline = previous


def agree_on_command(comm) -> None:
    """The first round of a job's ranks (:func:`require_mpi4py`, right after MPI_Init): every rank
    runs the same command of ``python -m minidist`` (:func:`running`; nothing to check outside
    it or on one rank). An MPMD launch (``mpiexec -n 1 ... evaluate : -n 3 ... train``) ran each
    command's rounds against the other's and ended in a traceback or a wait; now rank 0 prints one
    line naming the ranks and their commands and the job is aborted (status 2). A rank that does
    not take part within the command's ``--timeout`` (else ``p2p.get_timeout``) is named the same
    way (status 1)."""
    if _command is None or comm.Get_size() == 1:
        return
    previous = set_timeout(_deadline) if _deadline is not None else None
    try:
        commands = agree(comm, payload=_command, what="the ranks' commands")
    except CollectiveTimeout as error:
        print(f"minidist {_command}: error: start-up: {error}", file=sys.stderr, flush=True)
        abort_job(comm, 1)
    finally:
        if _deadline is not None:
            set_timeout(previous)
    if len(set(commands)) == 1:
        return
    if comm.Get_rank() == 0:
        who = "; ".join(f"{_ranks([r for r, c in enumerate(commands) if c == command])}: {command}"
                        for command in dict.fromkeys(commands))
        print(f"minidist {_command}: error: the ranks of this job run different commands ({who}); every rank of an "
              f"MPI job runs the same one: start them with one `mpiexec -n {len(commands)} python -m mpi4py -m "
              "minidist COMMAND ...`, not with mpiexec's ':'", file=sys.stderr, flush=True)
    abort_job(comm, 2)


# Start-up watchdog (``python -m minidist launch``). MPI_Init waits for every rank of the job, with
# no deadline: a rank stopped or dead before it leaves the others spinning in it forever, silent,
# and nothing inside MPI can time out there. So the supervisor, outside MPI, gives each attempt a
# folder (STARTUP_ENV); each rank writes ``rank<r>.init`` there just before MPI_Init and
# ``rank<r>.ready`` just after (its rank read from the launcher's environment, world_from_env).
# Once one rank has reached MPI_Init, every rank must be out of it within the job's deadline
# (train's --timeout), or the supervisor ends the job naming the ranks that never came. The end is
# watched the same way: each rank writes ``rank<r>.finalize`` as it exits, just before MPI_Finalize,
# which also waits for every rank with no deadline; once one rank has, every rank must have and the
# job must have ended within twice the deadline and FINISH_SLACK seconds (a rank stopped inside
# MPI_Finalize, or before it). Twice: a rank that leaves early (sys.exit in the middle of a run) is
# named by the others' own waits, which give up after one deadline and end the job first.
STARTUP_ENV = "MINIDIST_STARTUP_DIR"
FINISH_SLACK = 10.0


def note_startup(stage: str) -> None:
    """Write this rank's marker ``rank<r>.<stage>`` ("init", "ready", "finalize") in the folder of
    :data:`STARTUP_ENV`; nothing outside a watched job or when the folder cannot be written."""
    folder, world = os.environ.get(STARTUP_ENV), world_from_env()
    if folder and world is not None:
        with contextlib.suppress(OSError):
            Path(folder, f"rank{world[0]}.{stage}").touch()


# The variables with which a user chooses the BLAS threads of each process (then we leave them alone).
BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

# Where launchers tell a process its place in the job before MPI starts: (rank, size) variables
# of MPICH's and Intel MPI's Hydra (PMI), Open MPI and MVAPICH2.
# MPICH's and Intel MPI's hydra, Open MPI's mpirun, MVAPICH2's, then Slurm's srun (its task id; under
# `srun --mpi=pmix` an MPICH build sets no PMI_* of its own). The first pair set wins.
WORLD_VARIABLES = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                   ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"))


def world_from_env() -> tuple[int, int] | None:
    """This process's ``(rank, size)`` in an MPI job, read from the launcher's environment
    (:data:`WORLD_VARIABLES`) without starting MPI; None outside ``mpiexec`` (or with a launcher
    that sets none of them). The command line uses it to print a usage error once, from rank 0,
    before it knows whether MPI is needed."""
    for rank_name, size_name in WORLD_VARIABLES:
        try:
            rank, size = int(os.environ[rank_name]), int(os.environ[size_name])
        except (KeyError, ValueError):
            continue
        if 0 <= rank < size:
            return rank, size
    return None


@contextlib.contextmanager
def one_blas_thread():
    """Within the block NumPy's BLAS runs one thread (threadpoolctl; the limits restored after),
    unless the user chose (one of BLAS_THREAD_VARIABLES is set): each command of ``python -m
    minidist`` runs in it. Yields 1, or None when the user's choice stands.

    Why: the course's matrices are small (the default GPT multiplies 2,048 x 64 by 64 x 256 at
    most), too small for a second thread to gain on an idle machine, and on a busy one every
    product waits for a core another process holds. Measured on this course's 2-core machine
    with other jobs running, ``train --model gpt --steps 30``: 713 and 768 ms a step with
    OpenBLAS's default two threads, 227 and 257 ms with one, the losses bit-identical; the whole
    default run took 1,525 s against 272 s (issue 36). Under mpiexec :func:`limit_blas_threads`
    then gives each rank its share of its node's cores."""
    if any(name in os.environ for name in BLAS_THREAD_VARIABLES):
        yield None
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield 1


def limit_blas_threads(comm):
    """Give each rank of ``comm`` its share of this node's cores for BLAS (NumPy's matrix
    products): ``max(1, cores // ranks on this node)`` threads, through threadpoolctl; returns
    that number, or None when the user chose (one of BLAS_THREAD_VARIABLES is set) or the
    world has one rank.

    Why: a BLAS library starts one thread per core in every process, so N ranks on a node each
    run ``cores`` threads that spin for cores the others hold. Measured here (2 cores, PipeDream
    on 4 ranks, 20 epochs): 54 s with the default threads, 4.1 s with one per rank. torchrun
    sets ``OMP_NUM_THREADS=1`` for the same reason.

    The ranks on this node are those whose host name (``socket.gethostname()``) is this rank's,
    learned in one :func:`minidist.p2p.agree` round that every rank joins (also one whose user
    chose the threads), within the collectives' deadline (``p2p.set_timeout``, train's
    ``--timeout``). Not ``comm.Split_type(COMM_TYPE_SHARED)``: that collective cannot time out,
    and a rank that stopped before it left the others waiting forever; now they raise
    CollectiveTimeout (a TimeoutError) naming it. On the sim every rank is on one host."""
    if comm.Get_size() == 1:
        return None
    host = socket.gethostname()
    try:
        hosts = agree(comm, payload=host)
    except CollectiveTimeout as error:
        raise CollectiveTimeout(f"counting the ranks on each node (for BLAS threads): {error}", error.rank,
                                error.missing) from None
    if any(name in os.environ for name in BLAS_THREAD_VARIABLES):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // hosts.count(host))
    threadpool_limits(limits=threads, user_api="blas")
    return threads


def finish(comm, status: int, timeout: float, command: str = "train") -> int:
    """End a rank of an MPI job without waiting forever: what ``train`` and ``evaluate`` do last.

    MPI_Finalize waits for every rank (measured with MPICH 5.0.2: a rank stopped with SIGSTOP
    before it left the others in MPI_Finalize forever), so first:

    - status 0, or 2 (a usage error every rank knows, printed once by rank 0): one bounded
      barrier, a :func:`minidist.p2p.agree` round within ``timeout`` seconds. Then MPI is
      finalized here, so that mpi4py's runner (``python -m mpi4py``) does not turn the exit
      status 2 into ``MPI_Abort`` and its "Abort(2)" line. A rank that is missing past
      ``timeout`` makes this one print one line naming it (``minidist train: error: rank 0 cannot
      finish: rank 1 did not reach the end of the job within 5 s ...``) and abort the job
      (``comm.Abort``), which ends the missing rank too;
    - any other status (a run that failed on this rank: its error is printed): ``comm.Abort``
      at once, with that status (what mpi4py's runner does too, now also without it).

    Returns ``status`` (nothing to do with ``comm`` None or one rank); does not return when it
    aborts. stdout and stderr are flushed first, so nothing printed is lost."""
    if comm is None or comm.Get_size() == 1:
        return status
    sys.stdout.flush()
    sys.stderr.flush()
    if status not in (0, 2):
        abort_job(comm, status)
    previous = set_timeout(timeout)
    try:
        agree(comm)
    except CollectiveTimeout as error:
        who = f"rank{'s' if len(error.missing) > 1 else ''} {', '.join(map(str, error.missing))}"
        print(f"minidist {command}: error: rank {comm.Get_rank()} cannot finish: {who} did not reach the end of the "
              f"job within {timeout:g} s (stopped, stuck or dead?); aborting the job", file=sys.stderr, flush=True)
        abort_job(comm, status or 1)
    finally:
        set_timeout(previous)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(comm, mpi.Comm) and not mpi.Is_finalized():
        mpi.Finalize()
    return status


# Seconds a failing rank waits between printing its error and MPI_Abort: the abort tears down
# mpiexec's proxies, and a line already written to the pipe but not yet forwarded is lost with
# them (a fresh-clone check saw a diverging 2-rank pipeline exit 1 with no error line at all,
# though both ranks had printed theirs).
ABORT_GRACE = 0.5


def abort_job(comm, status: int):
    """``comm.Abort(status)`` after :data:`ABORT_GRACE` seconds (this rank's output forwarded
    first), and never return: MPICH's MPI_Abort (5.0.2, measured) returns while its process
    manager is still on the way to kill the job, and the code after it ran for a moment; this
    process then exits at once, without finalizing MPI. Flushes stdout and stderr first."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_GRACE)
    comm.Abort(status)
    os._exit(status)


@functools.lru_cache(maxsize=8)
def mpi_flavor(mpiexec: str) -> str:
    """"Open MPI", "MPICH" or "unknown", from ``mpiexec --version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20)
        text = (out.stdout + out.stderr).lower()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "open mpi" in text or "openrte" in text or "open-mpi" in text:
        return "Open MPI"
    if "hydra" in text or "mpich" in text:
        return "MPICH"
    return "unknown"


def mpiexec_command(script, n, args=(), mpiexec=None) -> list:
    """The command line ``launch`` runs (a list of str)."""
    if int(n) != n or n < 1:
        raise ValueError(f"number of ranks must be a positive integer, got {n!r}")
    mpiexec = mpiexec or find_mpiexec()
    flags = ["--allow-run-as-root", "--oversubscribe"] if mpi_flavor(mpiexec) == "Open MPI" else []
    return [mpiexec, "-n", str(int(n)), *flags, sys.executable, "-m", "mpi4py", str(script), *map(str, args)]


def launch(script, n, timeout=120.0, args=(), env=None, mpiexec=None, cwd=None) -> LaunchResult:
    """Run ``mpiexec -n n python -m mpi4py script args...`` and wait at most ``timeout`` s.

    env: extra environment variables, added to this process's environment (the ranks also
    get PYTHONUNBUFFERED=1, so output printed before a crash is not lost; the ranks write
    concurrently, so print from one rank, or expect lines from several to interleave).
    Returns a LaunchResult (``.returncode``, ``.stdout``, ``.stderr``, ``.ok``, ``.check()``);
    a failing job is a result, not an exception. Raises FileNotFoundError for a missing
    script, LaunchError when mpiexec or mpi4py is missing (naming the fix:
    ``pip install mpi4py mpich``), LaunchTimeout when the job runs past the timeout."""
    if not Path(script).is_file():
        raise FileNotFoundError(f"no script at {script}")
    require_mpi4py()
    command = mpiexec_command(script, n, args, mpiexec)
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env,
                            cwd=cwd, start_new_session=True)  # its own process group, to kill it whole
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _kill(proc)
        raise LaunchTimeout(f"{' '.join(command)} ran past its timeout of {timeout:g} s and was killed",
                            _text(stdout), _text(stderr)) from None
    except BaseException:  # interrupted (Ctrl-C, a notebook cell's timeout): leave no ranks behind
        _kill(proc)
        raise
    return LaunchResult(command, proc.returncode, _text(stdout), _text(stderr), time.perf_counter() - start)


def _kill(proc, first: int = signal.SIGTERM, grace: float = 3.0):
    """End the job's whole process group (mpiexec and every rank): signal ``first``, then, after
    ``grace`` seconds, SIGKILL (which also ends a stopped rank); collect the output."""
    for sig, wait in ((first, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return b"", b""


def _text(data) -> str:
    return (data or b"").decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------
# python -m minidist launch: restart a failed training job from its checkpoints
# ---------------------------------------------------------------------------------------

TIMED_OUT = 124  # the status of an attempt killed at its timeout, as timeout(1) gives


def train_command(n: int, train_args, *, use_mpiexec: bool = True, mpiexec=None) -> list:
    """The command line of one ``train`` attempt: ``mpiexec -n n python -m mpi4py -m minidist
    train ARGS`` (see :func:`mpiexec_command`), or ``python -m minidist train ARGS`` without
    mpiexec (one process: ``use_mpiexec=False`` needs n == 1). Raises ValueError for a bad n,
    LaunchError when mpiexec is needed and missing."""
    if not use_mpiexec:
        if n != 1:
            raise ValueError(f"without mpiexec there is one process; got n={n}")
        return [sys.executable, "-m", "minidist", "train", *map(str, train_args)]
    return mpiexec_command("-m", n, ["minidist", "train", *train_args], mpiexec)


def supervise(n: int, train_args, max_restarts: int = 3, timeout: float | None = None, *,
              use_mpiexec: bool = True, mpiexec=None, log=None, env=None, min_ranks: int | None = None,
              fits=None) -> int:
    """Run a training job and relaunch it from its checkpoints when it fails, at most
    ``max_restarts`` times: ``python -m minidist launch`` (torchrun's ``--max-restarts``, the
    elastic agent's restart of the whole job, with a fixed number of ranks).

    The first attempt runs ``train ARGS`` on ``n`` ranks (:func:`train_command`); when an
    attempt exits with a nonzero status, the next one runs ``train ARGS --resume`` (added once),
    which continues from the newest valid checkpoint in the ``--checkpoint-dir`` that ARGS must
    name (:class:`minidist.fault.Checkpointer`), so a restarted run ends with the weights of a
    run never stopped. One line per restart goes to ``log`` (default: stderr), e.g.
    ``restart 1/3 after exit code 137 (a rank was killed by SIGKILL) ...``. The ranks'
    output goes straight to this process's stdout and stderr.

    Not restarted: success (0), and exit status 2, a usage error that would fail the same way
    again (train's flags, or a ``--checkpoint-dir`` that holds another run:
    ``checkpoint_io.CheckpointMismatchError``). An attempt running past ``timeout`` seconds
    (None: no limit; the job's own waits
    stop at train's ``--timeout``) has its whole process group killed and counts as a failure
    with status 124; so does an attempt whose ranks do not all get through MPI_Init within train's
    ``--timeout`` once one rank has reached it (the start-up watchdog, :func:`_watch_startup`: a
    rank stopped or dead before MPI_Init left the others in it forever), with a line naming the
    missing ranks. SIGINT (Ctrl-C), SIGTERM or SIGHUP to this process ends the job (the signal
    passed on to its whole process group, SIGKILL after :data:`STOP_GRACE` seconds) and raises
    :class:`Stopped` (``python -m minidist launch`` then exits with 128 + the signal's number).

    Elastic (``min_ranks`` K, torchrun's ``--nnodes K:N``): each restart runs on fewer ranks,
    one fewer than the last attempt's (none above the ARGS' ``--global-batch-size`` G: each rank
    reads part of it, off by one row when the number does not divide G), down to K, then stays
    there; ``fits`` (a predicate on a number of ranks, :func:`elastic_sizes`) replaces that
    rule for a job with others (tp: a number its model splits over). The policy: a failed
    attempt is taken as a lost rank (a job cannot tell a dead node from a transient fault, and a
    node that died is not back at the next attempt), so the job goes on with what is left
    rather than waiting for it; G fixed keeps the run the same run (``data.GlobalBatchSampler``,
    resharded checkpoints: the resumed run ends with the weights of one that never stopped, to
    rounding). The line then reads ``relaunching on 3 ranks (was 4): restart 1/3 after exit code 137 ...``.

    Returns the last attempt's exit status: the ``returncode`` of the process (mpiexec, or
    python without it): 0, a status, or minus a signal's number when the one process was
    killed by a signal (the command line reports 128 + the number, as a shell does).
    Raises ValueError when ARGS name no ``--checkpoint-dir`` (nothing to restart from) or
    for a negative ``max_restarts``; with ``min_ranks``, when it is not in [1, n], ARGS give
    no ``--global-batch-size``, or no mpiexec is used; LaunchError when mpiexec or mpi4py is
    missing."""
    args = [str(a) for a in train_args]
    if _flag(args, "--checkpoint-dir") is None:
        raise ValueError("launch restarts a failed job from its checkpoints: the train flags need --checkpoint-dir DIR")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    sizes = elastic_sizes(n, min_ranks, _flag(args, "--global-batch-size"), use_mpiexec, fits)
    if use_mpiexec:
        require_mpi4py()
    log = log or supervisor_log
    first = train_command(n, args, use_mpiexec=use_mpiexec, mpiexec=mpiexec)
    resume = args if "--resume" in args else [*args, "--resume"]
    retry = first if "--resume" in args else [*first, "--resume"]
    # The watchdog's markers go in the checkpoint folder, which every node must see anyway (a restart reads it).
    startup = dict(startup=_startup_seconds(args), startup_dir=_flag(args, "--checkpoint-dir")) if use_mpiexec else {}
    with contextlib.suppress(OSError):
        os.makedirs(_flag(args, "--checkpoint-dir"), exist_ok=True)
    if not os.path.isdir(_flag(args, "--checkpoint-dir")):
        startup = {}  # train says what is wrong with the folder
    if sizes is None:
        return run_with_restarts(first, retry, max_restarts, timeout, log=log, env=env, **startup)

    def relaunch(restart: int):  # restart k runs on sizes[k] ranks (the last size once the list ends)
        ranks, was = sizes[min(restart, len(sizes) - 1)], sizes[min(restart - 1, len(sizes) - 1)]
        head = f"relaunching on {ranks} ranks (was {was})" if ranks != was else f"relaunching on {ranks} ranks again"
        return train_command(ranks, resume, mpiexec=mpiexec), head

    return run_with_restarts(first, relaunch, max_restarts, timeout, log=log, env=env, **startup)


def _startup_seconds(args: list[str]) -> float:
    """How long the start-up watchdog lets the ranks take through MPI_Init: train's ``--timeout``
    in ARGS, the deadline of every other wait, else the collectives' default (``p2p.get_timeout``)."""
    seconds = _timeout_flag(args)
    return seconds if seconds is not None else get_timeout()


def _timeout_flag(args: list[str]) -> float | None:
    """``--timeout`` in ARGS when it is a positive finite number of seconds, else None."""
    try:
        seconds = float(_flag(args, "--timeout") or "nan")
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None



def supervisor_log(line: str) -> None:
    """Print one of the supervisor's lines on stderr. In a terminal it starts on a new line: the
    failed attempt's progress bar (tqdm, rank 0) ends without one, and the line was glued to it;
    into a pipe or a file it is the line alone."""
    lead = "\n" if sys.stderr.isatty() else ""
    print(f"{lead}{line}", file=sys.stderr, flush=True)

def elastic_sizes(n: int, min_ranks: int | None, global_batch, use_mpiexec: bool = True,
                  fits=None) -> list[int] | None:
    """The numbers of ranks an elastic job's attempts run on (:func:`supervise`): ``n``, then
    each smaller number down to ``min_ranks`` for which ``fits(m)`` is true, by default each one
    at most the global batch (a data-parallel rank reads a part of it,
    ``data.split_global_batch``: equal when the number divides it, else off by one row; a tp job
    passes its model's rule instead, since every tp rank reads all of G); None without
    ``min_ranks``. Raises ValueError, naming the fix,
    for ``min_ranks`` outside [1, n], a global batch not given (None) or not a positive integer,
    or no mpiexec (one process cannot shrink)."""
    if min_ranks is None:
        return None
    if not 1 <= min_ranks <= n:
        raise ValueError(f"--min-ranks must be in [1, {n}] (the job starts on -n {n} and shrinks down to it), got "
                         f"{min_ranks}")
    if not use_mpiexec:
        raise ValueError("--min-ranks needs a job under mpiexec (not a one-process strategy): one process cannot "
                         "shrink")
    try:
        g = int(global_batch)
    except (TypeError, ValueError):
        g = 0
    if g < 1:
        raise ValueError("--min-ranks relaunches the job on fewer ranks with the same global batch: the train flags "
                         "need --global-batch-size G")
    fits = fits or (lambda m: m <= g)
    return [n] + [m for m in range(n - 1, min_ranks - 1, -1) if fits(m)]


def _flag(args: list[str], flag: str) -> str | None:
    """The value given to ``flag`` in ``args`` (``--flag V`` or ``--flag=V``; the last one), or
    None when it is not there."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag:
            value = args[i + 1] if i + 1 < len(args) else ""
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


# The signals a supervisor passes on to its job before it ends: a terminal's Ctrl-C (SIGINT),
# `kill`, `timeout` and batch systems (SIGTERM), a closed terminal or ssh session (SIGHUP).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE = 5.0  # seconds the job has to end after the forwarded signal, before SIGKILL


class Stopped(BaseException):
    """The supervisor received one of :data:`FORWARDED_SIGNALS` (``signum``) and ended its job:
    it forwarded the signal to the job's process group, waited at most :data:`STOP_GRACE`
    seconds and then killed what was left. ``status`` is ``128 + signum``, the exit status
    a shell reports for a process the signal ended (130 for Ctrl-C, 143 for SIGTERM). A
    BaseException, as KeyboardInterrupt is, so that no ``except Exception`` swallows it."""

    def __init__(self, signum: int):
        self.signum, self.status = signum, 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def run_with_restarts(first: list, retry, max_restarts: int, timeout: float | None = None, *,
                      log=print, env=None, startup: float | None = None, startup_dir: str | None = None) -> int:
    """Run ``first``; while it fails (a status other than 0 and 2), run ``retry``, at most
    ``max_restarts`` times; return the last status (see :func:`supervise`, which builds the
    commands). ``retry``: a command, or ``retry(k) -> (command, head)`` giving restart k's
    command (k from 1) and the start of its line (an elastic job's ``relaunching on 3 ranks
    (was 4)``). Each command runs in its own process group, killed whole at ``timeout``.
    Raises :class:`Stopped` when this process receives SIGINT, SIGTERM or SIGHUP (in the main
    thread, where Python runs signal handlers): the running attempt's whole process group gets
    the signal, then SIGKILL after :data:`STOP_GRACE` seconds, so neither mpiexec nor a rank
    outlives the supervisor (they would go on training and writing checkpoints). ``startup``
    (seconds, None: off): the start-up watchdog of an mpiexec command (:func:`_watch_startup`):
    once one rank reached MPI_Init, every rank must be out of it within that time, or the
    attempt is ended (a failure, status TIMED_OUT) with one line naming the missing ranks; the
    ranks write their markers in a folder made in ``startup_dir`` (default: the system's
    temporary folder, which ranks on other nodes do not see: give a shared one)."""
    command, restarts = first, 0
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with _signals_raise_stopped():
        while True:
            status = _attempt(command, timeout, child_env, log, startup, startup_dir)
            if status in (0, 2):
                if status == 2 and restarts < max_restarts:
                    log("launch: not restarting after exit code 2, a usage error (it would fail the same way again)")
                return status
            if restarts >= max_restarts:
                if max_restarts:
                    log(f"launch: giving up after {max_restarts} restarts; the last attempt exited with code {status}")
                return status
            restarts += 1
            if callable(retry):
                command, head = retry(restarts)
                log(f"{head}: restart {restarts}/{max_restarts} after exit code {status}{_why(status)}, from the "
                    "checkpoints with --resume")
            else:
                command = retry
                log(f"restart {restarts}/{max_restarts} after exit code {status}{_why(status)}: "
                    f"{_describe(first, retry)}")


@contextlib.contextmanager
def _signals_raise_stopped():
    """Within the block, SIGINT, SIGTERM and SIGHUP raise :class:`Stopped` (main thread only:
    elsewhere Python cannot install handlers, and the block changes nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _attempt(command: list, timeout, env, log, startup: float | None = None, startup_dir: str | None = None) -> int:
    """Run one attempt to its end or its timeout; its exit status (TIMED_OUT for a timeout, or
    when the start-up watchdog ended it: :func:`_watch_startup`, ``startup`` seconds, None: off;
    its markers in a folder made in ``startup_dir``, default the system's temporary folder)."""
    ranks = _ranks_of(command) if startup else None
    with tempfile.TemporaryDirectory(prefix=".minidist-startup-", dir=startup_dir) as folder:
        proc = subprocess.Popen(command, env={**env, STARTUP_ENV: os.path.abspath(folder)} if ranks else env,
                                start_new_session=True)  # its own process group, to kill it whole
        began = time.monotonic()
        try:
            deadline = began + (timeout or math.inf)
            stuck = (_watch_startup(proc, folder, ranks, startup, deadline)
                     or _watch_finish(proc, folder, ranks, 2 * startup + FINISH_SLACK, deadline)) if ranks else None
            if stuck is not None:
                _kill(proc)
                log(f"launch: {stuck}; ended the job")
                return TIMED_OUT
            return proc.wait(timeout=None if timeout is None else max(0.0, began + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(proc)
            log(f"launch: the attempt ran past its timeout of {timeout:g} s; killed it")
            return TIMED_OUT
        except Stopped as stopped:  # pass the signal on to mpiexec and every rank, then make sure
            if threading.current_thread() is threading.main_thread():
                for sig in FORWARDED_SIGNALS:  # a second Ctrl-C must not cut the clean-up short
                    signal.signal(sig, signal.SIG_IGN)
            _kill(proc, stopped.signum, STOP_GRACE)
            raise
        except BaseException:  # anything else (a notebook's interrupt): leave no ranks behind
            _kill(proc)
            raise


def _ranks_of(command: list) -> int | None:
    """The number of ranks of an ``mpiexec -n N ...`` command, None for any other."""
    if len(command) > 2 and command[1] == "-n" and "mpiexec" in os.path.basename(str(command[0])):
        with contextlib.suppress(ValueError):
            return int(command[2])
    return None


def _watch(proc, seconds: float, deadline: float, look) -> str | None:
    """The watchdogs' one loop: every 0.1 s while ``proc`` runs and before ``deadline``
    (time.monotonic), ``look() -> (started, over, problem)`` reads the markers; None once ``over``,
    and ``problem`` (the line naming the ranks, as the markers stand then) once ``seconds`` have
    passed since ``started`` first held. None when the job ends or the deadline passes first."""
    first = None
    while proc.poll() is None and time.monotonic() < deadline:
        started, over, problem = look()
        if over:
            return None
        if started and first is None:
            first = time.monotonic()
        if first is not None and time.monotonic() - first > seconds:
            return problem
        time.sleep(0.1)
    return None


def _marked(folder: str, ranks: int, stage: str) -> tuple[list[int], list[int]]:
    """(the ranks whose marker ``rank<r>.<stage>`` is in ``folder``, those whose is not)."""
    names = set(os.listdir(folder))
    marked = [r for r in range(ranks) if f"rank{r}.{stage}" in names]
    return marked, [r for r in range(ranks) if r not in marked]


def _watch_startup(proc, folder: str, ranks: int, seconds: float, deadline: float) -> str | None:
    """Watch the start-up markers (:data:`STARTUP_ENV`) of a job of ``ranks`` ranks: None once
    every rank is out of MPI_Init, or the job ended, or ``deadline`` (time.monotonic) passed; the
    problem, naming the ranks, when some rank reached MPI_Init ``seconds`` ago and not every rank is
    out of it yet."""
    def look():
        (entered, absent), (_, inside) = _marked(folder, ranks, "init"), _marked(folder, ranks, "ready")
        problem = (f"start-up: {_ranks(absent)} never reached MPI_Init (stopped, or dead before MPI started?) while "
                   f"{_ranks(entered)} waited for {seconds:g} s in it" if absent else
                   f"start-up: {_ranks(inside)} did not finish MPI_Init within {seconds:g} s (a rank stopped inside "
                   "it?)")
        return bool(entered), not inside, problem

    return _watch(proc, seconds, deadline, look)


def _watch_finish(proc, folder: str, ranks: int, seconds: float, deadline: float) -> str | None:
    """Watch the end of a job of ``ranks`` ranks whose start-up went well: None once the job
    ended, or ``deadline`` (time.monotonic) passed; the problem, naming the ranks, when a rank
    marked ``rank<r>.finalize`` (:data:`STARTUP_ENV`) ``seconds`` ago and the job still runs,
    either because other ranks never reached MPI_Finalize or because one is stuck inside it."""
    def look():
        done, absent = _marked(folder, ranks, "finalize")
        problem = (f"end: {_ranks(absent)} never reached MPI_Finalize (stopped or stuck after the run?) while "
                   f"{_ranks(done)} waited for {seconds:g} s in it" if absent else
                   f"end: the job did not end within {seconds:g} s after every rank reached MPI_Finalize (a rank "
                   "stopped inside it?)")
        return bool(done), False, problem

    return _watch(proc, seconds, deadline, look)


def _ranks(numbers: list[int]) -> str:
    return f"rank{'s' * (len(numbers) != 1)} {', '.join(map(str, numbers))}"


def _describe(first: list, retry: list) -> str:
    return "relaunching with --resume" if retry != first else "relaunching (the flags already resume)"


def _why(status: int) -> str:
    """A reading of an exit status: a signal number for a process killed by one."""
    number = -status if status < 0 else status - 128 if 128 < status < 160 else None
    if number is None:
        return " (the job timed out)" if status == TIMED_OUT else ""
    try:
        name = signal.Signals(number).name
    except ValueError:
        return ""
    return f" (killed by {name})" if status < 0 else f" (a process was killed by {name})"


# ---------------------------------------------------------------------------------------
# python -m minidist doctor
# ---------------------------------------------------------------------------------------

SMOKE_TEST = '''
import numpy as np
from mpi4py import MPI
from minidist import collectives
from minidist.launch import mpi_cuda_support
from minidist.node_layout import node_layout
from minidist.p2p import CollectiveError

comm = MPI.COMM_WORLD
rank, p = comm.Get_rank(), comm.Get_size()
rng = np.random.default_rng(rank)
x = rng.standard_normal(1001)
ours = collectives.all_reduce(comm, x, op="sum", algorithm="ring")
theirs = np.empty_like(x)
comm.Allreduce(x, theirs, op=MPI.SUM)
bound = p * np.finfo(x.dtype).eps * comm.allreduce(np.abs(x), op=MPI.SUM)
close = bool(np.all(np.abs(ours - theirs) <= bound))
xi = rng.integers(-1000, 1000, 1001)
theirs_i = np.empty_like(xi)
comm.Allreduce(xi, theirs_i, op=MPI.SUM)
exact = bool(np.array_equal(collectives.all_reduce(comm, xi, algorithm="ring"), theirs_i))
same = len(set(comm.allgather(ours.tobytes()))) == 1
verdicts = comm.gather((close, exact, same, float(np.max(np.abs(ours - theirs)))), root=0)
if rank == 0:
    ok = all(c and e and s for c, e, s, _ in verdicts)
    worst = max(d for _, _, _, d in verdicts)
    print(f"SMOKE {'OK' if ok else 'FAILED'} ranks={p} float64_max_abs_diff={worst:.3g} "
          f"int64_exact={all(e for _, e, _, _ in verdicts)} identical_on_all_ranks={all(s for _, _, s, _ in verdicts)}")
try:  # the nodes as the topology-aware all-reduces see them: host names, else MINIDIST_RANKS_PER_NODE
    layout = node_layout(comm)
    nodes = f"{layout.num_nodes} {layout.ranks_per_node} {layout.source}"
except CollectiveError as error:
    nodes = f"uneven {error}"
cuda = mpi_cuda_support()
if rank == 0:
    print(f"NODES {nodes}")
    print(f"CUDA {cuda}")
'''


def _version(module) -> str:
    if not _has_module(module):
        return "not installed"
    try:
        return importlib.import_module(module).__version__
    except Exception as exc:  # a broken install is what the doctor reports
        return f"installed but broken ({type(exc).__name__}: {exc})"


def _cupy_line() -> str:
    version = _version("cupy")
    if version == "not installed" or version.startswith("installed but"):
        return version
    return f"{version} ({'a GPU is visible' if cuda_available() else 'no GPU visible'})"


def _mpi_library_line() -> str:
    """MPI's library version, asked in a child process that does not initialize MPI."""
    code = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "print(MPI.Get_library_version().strip().splitlines()[0])")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "unknown (asking mpi4py timed out)"
    return " ".join(out.stdout.split()) if out.returncode == 0 else "unknown (mpi4py could not load MPI)"


def mpi_cuda_support() -> bool | None:
    """Whether the MPI library that mpi4py loaded takes GPU (CUDA) buffers, as it says itself:
    its ``MPIX_Query_cuda_support()`` (an extension of Open MPI >= 2.0 and MPICH >= 4.0: true
    when the library was built with CUDA and its runtime supports CUDA buffers; it must be
    called after MPI_Init, so call this inside an MPI job), or None when the library has no
    such function (mpi4py offers no portable query). The doctor's smoke test asks it."""
    from mpi4py import MPI  # noqa: PLC0415 (inside an MPI job only: importing it initializes MPI)

    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support  # found in mpi4py's MPI library
    except (OSError, AttributeError):
        return None
    query.restype = ctypes.c_int
    return bool(query())


def describe_cuda_aware(supported: bool | None, setting: str | None = None) -> str:
    """The doctor's line on CUDA-aware MPI: what the library says (:func:`mpi_cuda_support`:
    True, False or None for unknown) and what minidist does with GPU arrays under MPI, which
    follows ``setting``, the value of ``MINIDIST_CUDA_AWARE_MPI`` (None: unset; "1": hand
    them to MPI, else stage them through host memory: ``p2p.stage_to_host``)."""
    said = {True: "yes (MPIX_Query_cuda_support() = 1)", False: "no (MPIX_Query_cuda_support() = 0)",
            None: "unknown (this MPI library has no MPIX_Query_cuda_support)"}[supported]
    if setting == "1":
        use = "minidist hands GPU arrays to MPI (MINIDIST_CUDA_AWARE_MPI=1)"
        if supported is False:
            use += ", which this library cannot take: unset MINIDIST_CUDA_AWARE_MPI"
    else:
        use = "minidist copies GPU arrays through host memory"
        if supported:
            use += " (set MINIDIST_CUDA_AWARE_MPI=1 to hand them to MPI)"
    return f"{said}; {use}"


def describe_nodes(line: str) -> str:
    """The doctor's line on the job's nodes from the smoke test's ``NODES`` line (``"N l
    source"`` from ``minidist.node_layout``, or ``"uneven <error>"``)."""
    if line.startswith("uneven"):
        return f"no layout of equal nodes: {line[7:]}"
    num_nodes, per_node, source = line.split(" ", 2)
    where = {"host names": "by host name: ranks on different machines",
             "environment": "fake nodes of MINIDIST_RANKS_PER_NODE ranks, all on this machine",
             "one node": "every rank on this machine"}.get(source, source)
    return f"{num_nodes} node{'s' * (num_nodes != '1')} x {per_node} rank{'s' * (per_node != '1')} ({where})"


def doctor(ranks: int = 4, timeout: float = 120.0) -> int:
    """``python -m minidist doctor``: print versions, run the smoke test on ``ranks`` ranks
    through the launcher (killed after ``timeout`` seconds), print the job's nodes and ranks
    per node (``minidist.node_layout``: host names, else ``MINIDIST_RANKS_PER_NODE``) and
    whether the MPI library is CUDA-aware (:func:`describe_cuda_aware`), and a verdict.
    Returns 0 when everything works, 1 otherwise (the verdict lists the problems and their
    fixes). The flags are parsed and checked in :mod:`minidist.cli`."""
    print("minidist doctor")
    print(f"  python    {platform.python_version()} ({sys.executable})")
    print(f"  numpy     {_version('numpy')}")
    print(f"  cupy      {_cupy_line()}")
    print(f"  mpi4py    {_version('mpi4py')}")
    problems = []
    try:
        require_mpi4py()
        print(f"  MPI       {_mpi_library_line()}")
        mpiexec = find_mpiexec()
        print(f"  mpiexec   {mpiexec} ({mpi_flavor(mpiexec)})")
    except LaunchError as exc:
        problems.append(str(exc))
    if not problems:
        problems += _smoke_test(ranks, timeout)
    if problems:
        print("verdict: NOT READY")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print("verdict: OK, ready for the course")
    return 0


def _smoke_test(ranks, timeout) -> list:
    """Run SMOKE_TEST on ``ranks`` ranks; return the problems found ([] if none)."""
    print(f"smoke test: ring all_reduce vs MPI's Allreduce on {ranks} ranks ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "minidist_smoke.py"
        script.write_text(SMOKE_TEST)
        try:
            result = launch(script, ranks, timeout=timeout)
        except LaunchTimeout as exc:
            return [f"the smoke test timed out ({exc}); is another MPI job hogging the machine?"]
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("SMOKE")), None)
    if line:
        print(f"  {line[6:]}  ({result.seconds:.1f} s)")
    found = dict(ln.split(" ", 1) for ln in result.stdout.splitlines() if ln.startswith(("NODES ", "CUDA ")))
    if "NODES" in found:
        print(f"  nodes     {describe_nodes(found['NODES'])}")
    if "CUDA" in found:
        supported = {"True": True, "False": False}.get(found["CUDA"])
        print(f"  CUDA MPI  {describe_cuda_aware(supported, os.environ.get('MINIDIST_CUDA_AWARE_MPI'))}")
    if result.ok and line and line.startswith("SMOKE OK"):
        return []
    tail = "\n    ".join(result.stderr.strip().splitlines()[-10:])
    return [f"the smoke test failed (exit status {result.returncode}):\n    {tail or result.stdout[-500:]}"]

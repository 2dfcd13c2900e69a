"""The simulated world: N ranks as threads, run to the end or stopped (a failure, the
timeout), and the counters of its message trace. Its messages and waits are the post
office's (``minidist.sim.postoffice``), which :class:`World` extends.
"""
from __future__ import annotations

import ctypes
import operator
import threading
import time
import warnings

from threadpoolctl import threadpool_limits

from minidist.sim.comm import Comm
from minidist.sim.postoffice import EAGER_LIMIT, PostOffice, RankAborted, SimTimeoutError
from minidist.sim.topology import Topology

_stranded: list[threading.Thread] = []  # rank threads of timed-out worlds that could not be interrupted


class _RankInterrupted(BaseException):
    """Raised inside a rank thread that was still computing when its world timed out (a
    BaseException, like KeyboardInterrupt, so that ``except Exception`` does not swallow it)."""


def _warn_if_stranded():
    """Warn while rank threads of an earlier timed-out world are still alive."""
    _stranded[:] = [t for t in _stranded if t.is_alive()]
    if _stranded:
        names = ", ".join(t.name for t in _stranded)
        warnings.warn(f"{len(_stranded)} rank thread(s) of an earlier sim world that timed out are still running "
                      f"({names}): they share the CPU with this run, which may be slower. Restart the Python "
                      "process (the notebook's kernel) to stop them.", RuntimeWarning, stacklevel=3)


class World(PostOffice):
    """N simulated ranks. ``run(fn, *args, **kwargs)`` calls ``fn(comm, *args, **kwargs)`` on
    every rank (one thread each) and returns the per-rank results; afterwards ``trace``
    holds every message of that run, and ``messages_sent``, ``bytes_sent``, ... count them.
    ``timeout`` (seconds) bounds a whole run. ``strict=True`` makes every send synchronous
    (MPI's ``Ssend``); otherwise sends of more than ``eager_limit`` bytes (default
    ``EAGER_LIMIT``) wait for their receive (module docstring). ``stranded`` lists the ranks
    of the last run that timed out while computing and could not be interrupted.

    ``bandwidth`` (bytes per second, None: instant) makes the links slow: every ordered pair
    of ranks has a link that carries one message at a time, so a message of n bytes arrives
    n / bandwidth seconds after the link is free (at the earliest, after its send). A
    receive completes (and a synchronous send too) only once its message has arrived; an
    eager send still returns at once. Used to watch communication overlap with compute.
    Raises ValueError for a bandwidth that is not a positive number.

    ``topology`` (a :class:`~minidist.sim.topology.Topology` of ``size`` ranks, None: none)
    runs the world in *virtual time* (``minidist.sim.virtual_time``): each rank keeps a clock;
    a message of b bytes costs alpha + b / bandwidth of its link class, starting when its
    sender is ready and its port (or the node's shared network card) is free; receivers'
    clocks move to arrivals; ``comm.compute(seconds)`` stands for local work. After a run,
    ``makespan`` (the latest clock, seconds), ``clocks`` (each rank's) and ``timeline`` (the
    per-rank :class:`~minidist.sim.virtual_time.Interval` list, for Gantt plots) are exact and
    the same on every run, whatever the machine's load. Without a topology the world behaves
    as before. Raises ValueError when the topology's size is not ``size``, when it is not a
    Topology, or with ``bandwidth`` too (real-time links and virtual time do not mix)."""

    def __init__(self, size, timeout=60.0, strict=False, eager_limit=EAGER_LIMIT, bandwidth=None, topology=None):
        if isinstance(size, bool) or int(size) != size or size < 1:
            raise ValueError(f"world size must be a positive integer, got {size!r}")
        if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
            raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
        if isinstance(eager_limit, bool) or operator.index(eager_limit) < 0:
            raise ValueError(f"eager_limit must be a number of bytes >= 0, got {eager_limit!r}")
        if bandwidth is not None and (isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float))
                                      or not 0 < bandwidth < float("inf")):
            raise ValueError(f"bandwidth must be a positive number of bytes per second or None, got {bandwidth!r}")
        if topology is not None:
            if not isinstance(topology, Topology):
                raise ValueError(f"topology must be a minidist.sim.Topology (Topology.nodes(...)) or None, "
                                 f"got {type(topology).__name__}")
            if topology.size != size:
                raise ValueError(f"the world has {size} ranks but the topology has {topology.size} "
                                 f"({topology!r}): make them equal")
            if bandwidth is not None:
                raise ValueError("pass either bandwidth (real-time slow links) or topology (virtual time), not both")
        super().__init__(int(size), float(timeout), bool(strict), int(eager_limit),
                         None if bandwidth is None else float(bandwidth), topology)
        self.stranded: list[int] = []

    # -- running -------------------------------------------------------------------------
    def run(self, fn, *args, **kwargs):
        """Run ``fn(comm, *args, **kwargs)`` on every rank; return the list of results.

        If any rank raises, the others are stopped and the exception of the lowest rank
        that failed first-hand (not merely stopped) is re-raised here, with ``exc.rank``
        set and a note naming the rank. All per-rank exceptions stay in ``self.errors``."""
        _warn_if_stranded()
        self.reset()
        results = [None] * self.size
        threads = [threading.Thread(target=self._rank_main, args=(r, fn, args, kwargs, results),
                                    name=f"sim-rank-{r}", daemon=True) for r in range(self.size)]
        # The ranks already share the cores; a multi-threaded BLAS inside every rank would
        # oversubscribe them (20x slower for 4 ranks of small matmuls on 2 cores), so the
        # world runs with one BLAS thread, as one-process-per-core MPI jobs do.
        with threadpool_limits(limits=1):
            for t in threads:
                t.start()
            for t in threads:
                t.join(max(0.0, self.deadline - time.perf_counter()))
        if any(t.is_alive() for t in threads):  # past the timeout: stop the world; waiting ranks
            with self.cond:                    # raise at once, computing ones are interrupted
                self.failure = self.failure or (None, SimTimeoutError("timeout"))
                self.cond.notify_all()
            end = time.perf_counter() + 0.5
            for t in threads:
                t.join(max(0.0, end - time.perf_counter()))
            alive = [r for r, t in enumerate(threads) if t.is_alive()]
            self._stop_timed_out(threads, alive)
        if self.virtual is not None:  # messages posted but never waited for: time them too
            while self.virtual.grant_earliest():
                pass
        if self.errors:
            firsthand = {r: e for r, e in self.errors.items() if not isinstance(e, RankAborted)}
            rank = min(firsthand or self.errors)
            exc = self.errors[rank]
            note = f"raised on rank {rank} of {self.size} (minidist.sim)"
            if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", []):
                exc.add_note(note)
            exc.rank = rank
            raise exc
        return results

    def _stop_timed_out(self, threads, alive):
        """The run is past its timeout and ranks ``alive`` are still computing (outside any
        communication call). Stop the world, interrupt those threads (an exception raised at
        their next Python instruction), and raise SimTimeoutError naming every rank's state.
        A thread that cannot be interrupted (in a long C call or a sleep) is kept in
        ``self.stranded`` and every later run warns while it lives: it would share the CPU."""
        for r in alive:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threads[r].ident),
                                                       ctypes.py_object(_RankInterrupted))
        end = time.perf_counter() + 0.5
        for r in alive:
            threads[r].join(max(0.0, end - time.perf_counter()))
        self.stranded = [r for r in alive if threads[r].is_alive()]
        _stranded.extend(threads[r] for r in self.stranded)
        parts = []
        for r in range(self.size):
            if r in self.stranded:
                parts.append(f"rank {r} was computing and could not be interrupted (inside C code or a sleep): "
                             "it still runs in the background and slows later runs until it ends "
                             "(restart the Python process to stop it)")
            elif r in alive:
                parts.append(f"rank {r} was computing (outside communication) and has been interrupted")
            elif isinstance(self.errors.get(r), SimTimeoutError):
                suffix = f", and the sim world timed out after {self.timeout:g} s"
                parts.append(str(self.errors[r]).removesuffix(suffix))
        raise SimTimeoutError(f"sim world timed out after {self.timeout:g} s: " + "; ".join(parts))

    def _rank_main(self, rank, fn, args, kwargs, results):
        try:
            results[rank] = fn(Comm(self, rank), *args, **kwargs)
        except BaseException as exc:  # reported to the caller by run
            self.errors[rank] = exc
            with self.cond:
                if self.failure is None and not isinstance(exc, RankAborted):
                    self.failure = (rank, exc)
        finally:
            with self.cond:
                self.finished.add(rank)
                self.cond.notify_all()

    # -- virtual time (a world with a topology) -------------------------------------------
    def _virtual(self, what):
        if self.virtual is None:
            raise ValueError(f"{what}: this world has no virtual clock; create it with World(n, topology=...)")
        return self.virtual

    @property
    def makespan(self):
        """The last run's latest virtual clock (seconds). ValueError without a topology."""
        return self._virtual("makespan").makespan

    @property
    def clocks(self):
        """Each rank's virtual clock after the last run (a new list of seconds). ValueError
        without a topology."""
        return list(self._virtual("clocks").clocks)

    @property
    def timeline(self):
        """The last run's Gantt intervals (``Interval``: rank, kind "send"/"recv"/"compute",
        start, end, peer, link, nbytes, tag, label), sorted by rank and start; a message gives
        one "send" on its sender and one "recv" on its receiver, over the same span. ValueError
        without a topology."""
        return self._virtual("timeline").timeline

    # -- the trace -----------------------------------------------------------------------
    def _select(self, kind):
        if kind not in ("array", "object", "all"):
            raise ValueError(f"kind must be 'array', 'object' or 'all', got {kind!r}")
        return [m for m in self.trace if kind == "all" or m.kind == kind]

    def messages_sent(self, rank, kind="array"):
        """Number of messages ``rank`` sent (``kind``: "array", "object" or "all")."""
        return sum(1 for m in self._select(kind) if m.source == rank)

    def bytes_sent(self, rank, kind="array"):
        return sum(m.nbytes for m in self._select(kind) if m.source == rank)

    def messages_received(self, rank, kind="array"):
        return sum(1 for m in self._select(kind) if m.dest == rank and m.t_end is not None)

    def bytes_received(self, rank, kind="array"):
        return sum(m.nbytes for m in self._select(kind) if m.dest == rank and m.t_end is not None)

    def num_steps(self, kind="array"):
        """Logical steps the run's messages span (the latency terms of the algorithm)."""
        return 1 + max((m.step for m in self._select(kind)), default=-1)

    def summary(self):
        """A table of array messages and bytes per rank (pickled metadata on the last line)."""
        head = f"{'rank':>4} {'msgs sent':>10} {'bytes sent':>12} {'msgs recv':>10} {'bytes recv':>12}"
        rows = [head]
        for r in range(self.size):
            rows.append(f"{r:>4} {self.messages_sent(r):>10} {self.bytes_sent(r):>12} "
                        f"{self.messages_received(r):>10} {self.bytes_received(r):>12}")
        total = sum(self.bytes_sent(r) for r in range(self.size))
        rows.append(f"{'all':>4} {len(self._select('array')):>10} {total:>12}   "
                    f"in {self.num_steps()} steps")
        objects = self._select("object")
        if objects:
            rows.append(f"(+ {len(objects)} pickled metadata messages, {sum(m.nbytes for m in objects)} bytes)")
        return "\n".join(rows)


def run(fn, world_size, *args, **kwargs):
    """Run ``fn(comm, *args, **kwargs)`` on ``world_size`` simulated ranks; return the list of
    per-rank results (**contract**). For the message trace, use ``World(n).run(fn)``."""
    return World(world_size).run(fn, *args, **kwargs)

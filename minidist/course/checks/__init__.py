"""The checks that exercises call: messages with hints, gradient checks.

Every check raises ``AssertionError`` with a message a learner can act on: what was
checked, what was expected, what came out, and a hint. Because the checks run every time
the notebook runs, a wrong answer saved in a notebook still fails when nbval re-runs it.

In an exercise::

    from minidist.course import checks
    checks.check_close(mean([1, 2, 3]), 2.0, "mean([1, 2, 3])",
                       hint="add the values up and divide by how many there are")
    checks.check_gradient(lambda x: x.sigmoid(), [np.linspace(-2, 2, 5)], what="sigmoid")

One module per topic holds the checks of its exercises: ``checks.training`` (01, 02),
``checks.collectives`` (03, 04), ``checks.parallel`` (05, 06), ``checks.pipeline`` (07),
``checks.schedules`` (08), ``checks.pipedream`` (09), ``checks.memory`` (10), ``checks.precision`` (11),
``checks.fault`` (12), ``checks.transformer`` (13),
``checks.tensor_parallel`` (14), ``checks.sharding`` (15), ``checks.mesh`` (16), ``checks.topology`` (17),
``checks.elastic`` (18), ``checks.context_parallel`` (19), ``checks.experts`` (20),
``checks.across_datacenters`` (21), ``checks.serving`` (22).
``python -m minidist check NN``
(:mod:`minidist.course.runner`) runs an exercise as the grader does.

The learner's code must be the learner's: a check fails, saying so, when the function or class
it is given is minidist's own (:func:`check_own_code`: the same object, or code from the
``minidist`` package, e.g. ``checkpoint = minidist.recompute.checkpoint``), and while a check
declared with :func:`forbidding` runs the learner's code (:func:`call_learner`), the engine's
implementations it names raise when called (``return one_f_one_b(p, m)[rank]`` as the answer).

Longer than 400 lines: the checks' shared vocabulary (messages with hints, gradient checks, the
guard around a learner's code) that every topic's module imports.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
import sysconfig
import threading
import traceback
from pathlib import Path

import numpy as np

from minidist import backend, p2p, sim
from minidist.tensor import Tensor, no_grad

STUB_HINT = "this is still a stub: replace `# YOUR CODE HERE` and `raise NotImplementedError()` with your code"
DEADLOCK_HINT = ("every rank Sends before it Receives: past MPI's eager limit each Send waits for its Recv, "
                 "so the ring deadlocks; use comm.Sendrecv (or alternate the order on even/odd ranks)")

# ----------------------------------------------------------------------------- checks


def _as_numpy(value) -> np.ndarray:
    """A NumPy array from a number, list, NumPy/CuPy array or Tensor (its ``.data``)."""
    return backend.to_numpy(value.data if isinstance(value, Tensor) else value)


def fail(what: str, problem: str, hint: str = "") -> None:
    """Raise the AssertionError every check raises: ``"{what}: {problem}"`` and, when
    there is one, a line ``"Hint: {hint}"`` telling the learner what to try."""
    message = f"{what}: {problem}"
    if hint:
        message += f"\nHint: {hint}"
    raise AssertionError(message)


class LearnerError(AssertionError):
    """A check's failure because the learner's own code raised on this rank (a stub, a
    deadlock, an IndexError...). Unlike the failures every rank agrees on, the other ranks may
    still be waiting for this one, so an mpirun script reports it on the rank that raised it."""


# Where the learner's code is not: this package and the Python installation. The last
# traceback frame outside them is the learner's line (a notebook cell, an exercise file).
_NOT_LEARNER = tuple(str(Path(p).resolve()) for p in
                     {str(Path(__file__).resolve().parents[2]), *sysconfig.get_paths().values()})


def _is_learners(filename: str) -> bool:
    if filename.startswith("<"):  # compiled from a string (exec, some notebook front ends); not Python's own
        return not filename.startswith("<frozen ")
    return not str(Path(filename).resolve()).startswith(_NOT_LEARNER)


def _learner_frame(error: BaseException):
    """``(frame, callee)``: the last frame of ``error``'s traceback in the learner's code (not
    in minidist, not in Python's own libraries) and the name of the function it was calling
    when the error came ("Send"), or ``(None, "")``."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [k for k, f in enumerate(frames) if _is_learners(f.filename)]
    if not mine:
        return None, ""
    k = mine[-1]
    return frames[k], (frames[k + 1].name if k + 1 < len(frames) else "")


def learner_line(error: BaseException) -> str:
    """``"your line 7 in ring_all_reduce: comm.Send(chunk, dest=right)"``: where the
    learner's code was when ``error`` was raised, or "" when it was not in the traceback.
    In a notebook the line number counts from the top of the cell."""
    frame, _ = _learner_frame(error)
    return f"your line {frame.lineno} in {frame.name}: {(frame.line or '').strip()}" if frame else ""


def learner_error(what: str, error: Exception, name: str = "your function", hint: str = "") -> LearnerError:
    """The :class:`LearnerError` a check raises (``from None``) when the learner's code raised
    ``error``: ``"{what}: {problem}\nHint: {hint}\n{learner_line}"``. An untouched stub says
    so (NotImplementedError: :data:`STUB_HINT`); a deadlock on the simulated world is
    explained (a rank blocked in Send: :data:`DEADLOCK_HINT`) with the simulator's wait-for
    cycle; any other exception is named (``name`` is the learner's function) with ``hint``,
    or a generic one."""
    line, (_, callee) = learner_line(error), _learner_frame(error)
    if isinstance(error, NotImplementedError):
        problem, hint = STUB_HINT, ""
    elif engine_called(error):
        called = engine_called(error)
        whose = "the checks'" if called.startswith("minidist.course.") else "the engine's"
        problem = f"{name} called {called}, {whose} own implementation, not yours"
        hint = hint_for_own_code()
    elif isinstance(error, sim.DeadlockError):
        cycle = re.search(r"wait-for cycle: [^)]*", str(error))
        problem = "deadlock: every rank waits and none can proceed" + (f" ({cycle.group(0)})" if cycle else "")
        hint = DEADLOCK_HINT if callee in ("Send", "Ssend") else (
            "a rank waits for a message no rank sends: every Recv (and Wait) needs a matching Send "
            "on the rank it names, with the same tag, and no rank may return before its part is done")
        line += f"\nwho waits for whom (the simulator): {str(error).split('):', 1)[-1].strip()[:600]}"
    else:
        problem = f"{name} raised {type(error).__name__}: {error}"
        hint = hint or ("the call on your line below raised it: its message says what it expects" if callee
                        else "try it on a small case and print what each step computes")
    return LearnerError(f"{what}: {problem}" + (f"\nHint: {hint}" if hint else "") + (f"\n{line}" if line else ""))


def call_learner(what: str, fn, *args, hint: str = "", name: str = "", **kwargs):
    """``fn(*args, **kwargs)``, the learner's code, inside a check; returns its result.

    If it raises an ``Exception``, the check raises :func:`learner_error`'s
    :class:`LearnerError` instead, ``from None`` so that no sim or engine internals are
    chained to it: the hint first, then the learner's own line (``name`` says what raised,
    default "your <fn's name>"). AssertionError (a check's own
    failure, raised inside) and :class:`minidist.sim.RankAborted` (another rank failed first;
    the simulated world reports that one) pass through unchanged.
    """
    try:
        with armed():
            return fn(*args, **kwargs)
    except (AssertionError, sim.RankAborted):
        raise
    except Exception as error:  # every learner error becomes a check failure
        raise learner_error(what, error, name or f"your {getattr(fn, '__name__', 'function')}", hint) from None


# ----------------------------------------------------------------------------- the learner's own code

# Where minidist's own code lives: a learner's function or class whose code is there is not theirs.
_PACKAGE = str(Path(__file__).resolve().parents[2])
_TRIPWIRE_MARK = "minidist-check-tripwire: "


def _unwrap(obj):
    """The plain function or class behind a bound method, staticmethod, classmethod, partial or
    ``functools.wraps`` wrapper."""
    for _ in range(20):
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif isinstance(obj, (staticmethod, classmethod)) or inspect.ismethod(obj):
            obj = obj.__func__
        elif getattr(obj, "__wrapped__", None) is not None and not isinstance(obj, type):
            obj = obj.__wrapped__
        else:
            return obj
    return obj


def _source_file(obj) -> str:
    """The file that defines ``obj`` (a function, a class, a callable object's class), or ""."""
    obj = _unwrap(obj)
    code = getattr(obj, "__code__", None)
    if code is not None:
        return code.co_filename
    cls = obj if isinstance(obj, type) else None
    module = sys.modules.get(getattr(cls, "__module__", "") or "")
    return getattr(module, "__file__", "") or ""


def _engine_part(obj, methods=()) -> tuple[str, str]:
    """``(method, dotted name)`` of the first part of ``obj`` that is minidist's own (``method``
    "" for ``obj`` itself), or ``("", "")``; see :func:`engine_origin`."""
    candidates = [(obj, "")] + ([(getattr(obj, m, None), m) for m in methods] if isinstance(obj, type) else [])
    for candidate, method in candidates:
        if candidate is None:
            continue
        found = _unwrap(candidate)
        path = _source_file(found)
        if path and not path.startswith("<") and str(Path(path).resolve()).startswith(_PACKAGE):
            module = getattr(found, "__module__", None) or "minidist"
            return method, f"{module}.{getattr(found, '__qualname__', getattr(found, '__name__', repr(found)))}"
    return "", ""


def engine_origin(obj, methods=()) -> str:
    """The dotted name of minidist's own function or class that ``obj`` is, or "".

    ``obj`` is minidist's when it (unwrapped: bound methods, staticmethods, partials,
    ``functools.wraps``) is defined in a file of the ``minidist`` package, i.e. it is the same
    object as the engine's (``checkpoint = minidist.recompute.checkpoint``) or runs its code
    object (``types.FunctionType(engine.__code__, ...)``); a class is judged by its module. For
    a class, each of ``methods`` (names) is looked up on it too, so a subclass that inherits
    the engine's ``update`` gives the name of the engine's ``update``."""
    return _engine_part(obj, methods)[1]


def hint_for_own_code() -> str:
    """The hint every check gives when the learner's answer is minidist's own code."""
    return ("the exercise is to write it yourself: minidist's version is there to read and to compare with, and the "
            "checks compare your code with an oracle, not with it")


def check_own_code(obj, what: str, methods=()) -> None:
    """Fail (AssertionError, with :func:`hint_for_own_code`) when ``obj``, the learner's function
    or class, is minidist's own (:func:`engine_origin`): ``"{what}: this is <name>, the engine's own
    implementation, not yours"`` (``"its update is <name>"`` for an inherited method of
    ``methods``; "the checks' own" for a reference the checks keep)."""
    method, origin = _engine_part(obj, methods)
    if origin:
        whose = "the checks'" if origin.startswith("minidist.course.") else "the engine's"
        part = f"its {method} is" if method else "this is"
        fail(what, f"{part} {origin}, {whose} own implementation, not yours", hint_for_own_code())


def _tripwire(*args, **kwargs):
    raise RuntimeError("minidist-check-tripwire: PLACEHOLDER")


def _tripwire_code(function):
    """A code object for ``function`` that raises RuntimeError naming it (builtins only: it runs
    with ``function``'s own globals)."""
    name = f"{function.__module__}.{function.__qualname__}"
    consts = tuple(_TRIPWIRE_MARK + name if isinstance(c, str) and c.startswith(_TRIPWIRE_MARK) else c
                   for c in _tripwire.__code__.co_consts)
    return _tripwire.__code__.replace(co_consts=consts, co_name=function.__name__)


def engine_called(error: BaseException) -> str:
    """The engine function named by a tripwire's RuntimeError (see :func:`forbidding`), or ""."""
    text = str(error)
    return text[len(_TRIPWIRE_MARK):] if isinstance(error, RuntimeError) and text.startswith(_TRIPWIRE_MARK) else ""


_FORBIDDEN: list[tuple] = []  # the functions forbidden by the checks now running, one tuple per check
_ARMED = {"depth": 0, "saved": {}}
_ARMED_LOCK = threading.Lock()


@contextlib.contextmanager
def forbidding(*functions):
    """Context manager and decorator for a check: while it is active, the learner's code run
    through :func:`call_learner` (or inside :func:`armed`) may not call ``functions`` (the
    engine's implementations of what the exercise asks for; plain functions, or methods given
    as ``Class.method``): each raises RuntimeError, which :func:`learner_error` turns into
    "your code called <name>, the engine's own implementation, not yours". The check's own
    calls, outside :func:`armed`, are not affected. A function whose code has free variables
    (a closure) cannot be tripped and is ignored."""
    targets = tuple(f for f in (_unwrap(f) for f in functions)
                    if inspect.isfunction(f) and not f.__code__.co_freevars)
    _FORBIDDEN.append(targets)
    try:
        yield
    finally:
        _FORBIDDEN.remove(targets)


@contextlib.contextmanager
def armed():
    """While active (nested and from several threads alike), every function of the active
    :func:`forbidding` checks raises when called. :func:`call_learner` arms around the
    learner's call; a check that calls the learner's code itself wraps the call in this."""
    targets = {f for group in _FORBIDDEN for f in group}
    if not targets:
        yield
        return
    with _ARMED_LOCK:
        if _ARMED["depth"] == 0:
            for function in targets:
                _ARMED["saved"][function] = function.__code__
                function.__code__ = _tripwire_code(function)
        _ARMED["depth"] += 1
    try:
        yield
    finally:
        with _ARMED_LOCK:
            _ARMED["depth"] -= 1
            if _ARMED["depth"] == 0:
                for function, code in _ARMED["saved"].items():
                    function.__code__ = code
                _ARMED["saved"].clear()


# ----------------------------------------------------------------------------- several ranks


class SynchronousSends:
    """The communicator a learner's collective or pipeline stage gets in the checks: ``Send``
    is ``Ssend`` and ``Isend`` is ``Issend`` (each completes only once its receive is posted,
    whatever the size, as MPI may make any ``Send`` past its eager limit); every other
    attribute is ``comm``'s (an mpi4py communicator, a :mod:`minidist.sim` rank, a
    :class:`minidist.tracing.CountingComm`). So a ring or a pipeline that only works because
    small messages were buffered deadlocks in the check, as it would on larger ones."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Send(self, buf, dest, tag=0):  # mpi4py's name
        return self._comm.Ssend(buf, dest, tag)

    def Isend(self, buf, dest, tag=0):  # mpi4py's name
        return self._comm.Issend(buf, dest, tag)


def fail_together(comm, problem) -> None:
    """Collective over ``comm``: share this rank's ``problem`` (None, or ``(what, text, hint)``)
    with every rank and raise the lowest failing rank's on all of them, as :func:`fail`'s
    AssertionError with ``" (on rank r of p)"`` after the text; return when no rank has one.
    One :func:`minidist.p2p.agree` round, so no rank is left waiting for another that
    failed."""

    def raise_failure(item, rank, size):
        what, text, hint = item
        fail(what, f"{text} (on rank {rank} of {size})", hint)

    p2p.agree(comm, problem, raise_problem=raise_failure)


def run_under_mpi(name: str, checks_and_functions) -> int:
    """The end of every mpirun exercise script (``mpiexec -n P python -m mpi4py NN_topic.py``):
    run each ``check(comm, fn)`` of ``checks_and_functions`` (pairs, in order) on
    ``mpi4py.MPI.COMM_WORLD``. Rank 0 prints each verdict as its check passes, then
    ``"{name}: all checks pass on P ranks"``; returns the exit status, 0.

    A failed check (AssertionError) ends the script with status 1 and one ``AssertionError: ...``
    line on stderr: from rank 0 when every rank fails alike (a wrong answer), and from the rank
    that raised for a :class:`LearnerError` (the learner's code raised there, and the other ranks
    may be waiting for it). One write per message, so the ranks' lines do not interleave."""
    from mpi4py import MPI  # noqa: PLC0415 (the script's functions import without MPI)

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    try:
        for check, fn in checks_and_functions:
            verdict = check(comm, fn)
            if rank == 0:
                print(verdict, flush=True)
    except AssertionError as failure:
        if rank == 0 or isinstance(failure, LearnerError):
            sys.stderr.write(f"AssertionError: {failure}\n")
            sys.stderr.flush()
        return 1
    if rank == 0:
        print(f"{name}: all checks pass on {comm.Get_size()} ranks")
    return 0


def _show(array: np.ndarray) -> str:
    return np.array2string(array, precision=6, threshold=12, separator=", ") if array.ndim else f"{array.item()!r}"


def check(condition, what: str, hint: str = "") -> None:
    """Raise AssertionError("what ... Hint: hint") unless ``condition`` is true."""
    if not condition:
        fail(what, "this is not the case", hint)


def check_equal(actual, expected, what: str, hint: str = "") -> None:
    """Exact comparison of Python values (ints, strings, lists, tuples, dicts).
    Raises AssertionError naming ``what``, both values and the hint."""
    if actual is None and expected is not None:
        fail(what, f"expected {expected!r}, got None", hint or "did you forget to return the result?")
    if actual != expected:
        fail(what, f"expected {expected!r}, got {actual!r}", hint)


def check_shape(actual, shape: tuple, what: str, hint: str = "") -> None:
    """``actual`` (array, Tensor) has exactly ``shape``; raises AssertionError otherwise."""
    if actual is None:
        fail(what, f"expected an array of shape {tuple(shape)}, got None",
             hint or "did you forget to return the result?")
    got = tuple(getattr(actual, "shape", np.shape(actual)))
    if got != tuple(shape):
        fail(what, f"expected shape {tuple(shape)}, got shape {got}", hint)


def check_close(actual, expected, what: str, hint: str = "", *, rtol: float = 1e-6, atol: float = 1e-8) -> None:
    """``actual`` equals ``expected`` elementwise within ``atol + rtol·|expected|`` (NumPy's
    ``allclose`` rule), same shape (scalars and 0-d arrays are interchangeable).

    Accepts numbers, lists, NumPy/CuPy arrays and Tensors. Raises AssertionError naming
    ``what``, the expected and actual values, the largest difference and where it is, and
    ``hint``.
    """
    if actual is None:
        fail(what, "got None", hint or "did you forget to return the result?")
    try:
        a = _as_numpy(actual).astype(np.float64)
    except (TypeError, ValueError):
        fail(what, f"expected numbers like {expected!r}, got {type(actual).__name__} {actual!r}", hint)
    e = _as_numpy(expected).astype(np.float64)
    if a.shape != e.shape:
        fail(what, f"expected shape {e.shape}, got shape {a.shape}", hint)
    if np.isnan(a).any() and not np.isnan(e).any():
        fail(what, f"got NaN in {_show(a)}", hint or "look for a division by zero or a log of a non-positive number")
    if not np.allclose(a, e, rtol=rtol, atol=atol):
        diff = np.abs(a - e)
        worst = np.unravel_index(np.nanargmax(diff), diff.shape) if diff.ndim else ()
        where = f" at index {tuple(int(i) for i in worst)}" if diff.ndim else ""
        fail(what, f"expected {_show(e)}, got {_show(a)} (largest difference {np.nanmax(diff):.3g}{where})", hint)


def numerical_gradient(f, arrays: list[np.ndarray], eps: float = 1e-6) -> list[np.ndarray]:
    """Central differences of the scalar function ``f(arrays) -> float``:
    ``(f(x + eps·e_j) − f(x − eps·e_j)) / (2·eps)`` for every element ``j`` of every array.

    ``arrays`` are float64 NumPy arrays, perturbed in place and restored. Returns one
    gradient per array, same shapes. The error is O(eps²) from truncation plus O(1e-16/eps)
    from rounding, so eps = 1e-6 in float64 is good to about 1e-9 for smooth ``f``.
    """
    grads = []
    for a in arrays:
        grad = np.zeros_like(a)
        flat, flat_grad = a.reshape(-1), grad.reshape(-1)  # views: a is contiguous (np.array copy)
        for j in range(flat.size):
            old = flat[j]
            flat[j] = old + eps
            plus = f(arrays)
            flat[j] = old - eps
            minus = f(arrays)
            flat[j] = old
            flat_grad[j] = (plus - minus) / (2 * eps)
        grads.append(grad)
    return grads


def check_gradient(fn, inputs, *, what: str = "gradient", hint: str = "", seed: int = 0,
                   eps: float = 1e-6, rtol: float = 1e-5, atol: float = 1e-7) -> list[np.ndarray]:
    """Check the engine's backward pass of ``fn`` against central differences.

    ``fn`` takes Tensors (one per entry of ``inputs``) and returns a Tensor of any shape;
    ``inputs`` are arrays, lists or Tensors (copied to float64 on the CPU). An output with
    more than one element is contracted with a seeded random cotangent ``v``
    (``out.backward(v)``), which catches errors that cancel in a plain sum (needle's gradient
    check does the same); a one-element output uses ``v = 1``.
    Returns the analytic gradients (NumPy arrays). Raises AssertionError, with a hint, when an
    input gets no gradient, a gradient of the wrong shape, or wrong values, and
    :class:`LearnerError` when ``fn``'s forward or backward raises (a stub says so).
    """
    hint = hint or ("compare your backward with the derivative of your forward, term by term; where an "
                    "input is used twice, its gradients must be added; where it was broadcast, summed back")
    arrays = [np.array(_as_numpy(x), dtype=np.float64) for x in inputs]
    leaves = [Tensor(a.copy(), requires_grad=True) for a in arrays]

    def forward_backward():
        out = fn(*leaves)
        shape = np.shape(out.data)
        # A scalar (a loss) keeps the cotangent 1, so the messages show its plain gradient.
        cotangent = np.ones(shape) if np.size(out.data) == 1 else np.random.default_rng(seed).standard_normal(shape)
        out.backward(cotangent)
        return cotangent

    cotangent = call_learner(what, forward_backward, hint=hint, name="running forward and backward")

    def contracted(xs):
        with no_grad():
            return float((_as_numpy(fn(*[Tensor(x.copy()) for x in xs])) * cotangent).sum())

    numeric = numerical_gradient(contracted, arrays, eps)
    analytic = []
    for i, (leaf, expected) in enumerate(zip(leaves, numeric)):
        label = f"{what}, input {i}" if len(leaves) > 1 else what
        if leaf.grad is None:
            fail(label, "no gradient reached this input (.grad is None)",
                  "does backward return one gradient per input of forward, in the same order?")
        got = _as_numpy(leaf.grad)
        check_shape(got, expected.shape, label, "a gradient has the shape of its input; sum over broadcast axes")
        check_close(got, expected, label, hint, rtol=rtol, atol=atol)
        analytic.append(got)
    return analytic



"""The checks of exercises 01 and 02: pieces of the engine you rewrote, checked against an
oracle that does not share your code.

- :func:`check_backward` (exercise 01): your ``Function`` subclass's backward against central
  differences (:func:`minidist.course.checks.check_gradient`) on a fixed table of shapes and options
  for that kind of op (broadcasting, axes, keepdims).
- :func:`check_sgd_momentum_step` (exercise 02): your update against ``minidist.optim.SGD``
  fed the same gradients, to 1e-12 in float64.
- :func:`check_prefetch_loader` (exercise 02): your loader against
  ``minidist.data.PrefetchLoader``: the same batches in the same order over two epochs, a
  bounded look-ahead, loader errors re-raised in the caller, and the end of the data reported.
  Your loader is driven from a watchdog thread, so a deadlock becomes an ``AssertionError``
  after a few seconds instead of a notebook that hangs.

Each check raises ``AssertionError("what: problem\\nHint: ...")`` on the first problem and
returns a one-line verdict when everything passes::

    from minidist.course.checks import training as training_checks
    print(training_checks.check_backward(MyMul, "mul"))
"""
from __future__ import annotations

import threading
import time

import numpy as np

from minidist import data, optim
from minidist.course import checks
from minidist.course.checks import check_own_code, fail
from minidist.tensor import Tensor

SEED = 2024
WATCHDOG_S = 10.0


# ----------------------------------------------------------------------------- exercise 01

# For each kind of op: (cases, hint). A case is (input shapes, options for apply, how to draw
# the inputs); "positive" keeps divisors away from zero, "small" keeps exp from overflowing.
BACKWARD_CASES = {
    "add": ([((3, 4), (3, 4)), ((3, 4), (4,))],
            "d(a + b)/da = d(a + b)/db = 1: pass grad to both inputs, each unbroadcast to its own shape"),
    "mul": ([((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 3), (4, 1))],
            "d(a·b)/da = b and d(a·b)/db = a, times grad; then unbroadcast(..., a.shape) and (..., b.shape) "
            "so that an input that was broadcast gets the sum of its copies' gradients"),
    "div": ([((3, 4), (3, 4), "positive"), ((3, 4), (4,), "positive"), ((5,), (), "positive")],
            "d(a/b)/da = 1/b and d(a/b)/db = −a/b², times grad; unbroadcast each to its input's shape"),
    "exp": ([((3, 4), "small"), ((6,), "small")],
            "d exp(a)/da = exp(a), which forward already computed: save the output and multiply grad by it"),
    "tanh": ([((3, 4),), ((6,),)],
             "d tanh(a)/da = 1 − tanh(a)²; save the output in forward and use 1 − out·out"),
    "sum": ([((3, 4), {}), ((3, 4), {"axis": 0}), ((3, 4), {"axis": 1, "keepdims": True}),
             ((2, 3, 4), {"axis": (0, 2)}), ((2, 3, 4), {"axis": -1})],
            "every input element contributes once to its sum, so its gradient is the grad of that sum: "
            "put the summed axes back (np.expand_dims when keepdims was False) and np.broadcast_to the "
            "input's shape"),
    "matmul": ([((3, 4), (4, 5)), ((1, 3), (3, 2)), ((4, 4), (4, 1))],
               "for C = A @ B: dA = grad @ Bᵀ (shape of A) and dB = Aᵀ @ grad (shape of B)"),
}


def _draw(rng, shape, kind):
    x = rng.standard_normal(shape)
    if kind == "positive":  # |x| in [0.5, 2] with a random sign: far from a pole
        return rng.uniform(0.5, 2.0, shape) * np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    if kind == "small":
        return 0.5 * x
    return x


def check_backward(op, kind: str) -> str:
    """Check the backward of ``op`` (a ``minidist.tensor.Function`` subclass) against
    central differences on every case of ``BACKWARD_CASES[kind]`` ("add", "mul", "div",
    "exp", "tanh", "sum", "matmul").

    The inputs are seeded float64 arrays; a case with options (``sum``'s ``axis`` and
    ``keepdims``) passes them to ``op.apply``. Returns a one-line verdict. Raises
    AssertionError naming the case, with the op's derivative as the hint (also when your
    code raised another error, such as a NumPy shape error, then with your line); a stub
    says it is one; KeyError for an unknown ``kind``.
    """
    if kind not in BACKWARD_CASES:
        raise KeyError(f"check_backward: unknown kind {kind!r}; choose one of {', '.join(BACKWARD_CASES)}")
    check_own_code(op, f"the {kind} Function", methods=("forward", "backward"))
    cases, hint = BACKWARD_CASES[kind]
    rng = np.random.default_rng(SEED)
    for case in cases:
        options = case[-1] if isinstance(case[-1], dict) else {}
        draw = case[-1] if isinstance(case[-1], str) else None
        shapes = [s for s in case if isinstance(s, tuple)]
        arrays = [_draw(rng, shape, draw) for shape in shapes]
        where = " and ".join(str(s) for s in shapes)
        what = f"{op.__name__} on shape{'s' if len(shapes) > 1 else ''} {where}"
        if options:
            what += " with " + ", ".join(f"{k}={v}" for k, v in options.items())
        checks.check_gradient(lambda *tensors, options=options: op.apply(*tensors, **options), arrays,
                              what=what, hint=hint)
    return f"{op.__name__}: backward agrees with central differences on {len(cases)} cases"


# ----------------------------------------------------------------------------- exercise 02: SGD


def check_sgd_momentum_step(step, steps: int = 5) -> str:
    """Check ``step(param, grad, velocity, lr, momentum) -> (new_param, new_velocity)``, one
    SGD-with-momentum update of one NumPy parameter in PyTorch's form (v = μ·v + g;
    p = p − lr·v; the velocity starts at zeros), against ``minidist.optim.SGD``.

    Two parameters of different shapes, ``steps`` steps of seeded float64 gradients, momentum
    0 and 0.9: the parameters (and, with momentum, the velocities) must agree to 1e-12.
    Returns a one-line verdict; raises AssertionError with a hint for the step that differs.
    """
    check_own_code(step, "sgd_momentum_step")
    rng = np.random.default_rng(SEED)
    lr, shapes = 0.05, [(3, 4), (5,)]
    for momentum in (0.0, 0.9):
        start = [rng.standard_normal(s) for s in shapes]
        reference = [Tensor(p.copy(), requires_grad=True) for p in start]
        optimizer = optim.SGD(reference, lr=lr, momentum=momentum)
        params = [p.copy() for p in start]
        velocities = [np.zeros(s) for s in shapes]
        for t in range(steps):
            grads = [rng.standard_normal(s) for s in shapes]
            for ref, g in zip(reference, grads):
                ref.grad = g.copy()
            optimizer.step()
            for i, g in enumerate(grads):
                what = f"step {t + 1} with momentum {momentum}, parameter of shape {shapes[i]}"
                result = checks.call_learner(what, step, params[i], g.copy(), velocities[i], lr, momentum)
                if not (isinstance(result, tuple) and len(result) == 2):
                    fail(what, f"expected a tuple (new_param, new_velocity), got {type(result).__name__}",
                                 "return both arrays: return param, velocity")
                new_param, new_velocity = (np.asarray(r, dtype=np.float64) for r in result)
                if momentum == 0:
                    hint = "with momentum 0 the update is plain SGD: param − lr · grad"
                elif t == 0:
                    hint = ("the velocity starts at zero, so on the first step v = μ·0 + g = g and the "
                            "parameter moves by −lr · g")
                else:
                    hint = ("update the velocity first, v = momentum · v + grad, then step along it, "
                            "param − lr · v (PyTorch's form: lr multiplies v, not g)")
                checks.check_close(new_param, reference[i].data, f"{what}: the parameter", hint,
                                   rtol=0, atol=1e-12)
                if momentum:
                    checks.check_close(new_velocity, optimizer.velocity[i], f"{what}: the velocity",
                                       "return the new velocity v = momentum · v + grad (not scaled by lr)",
                                       rtol=0, atol=1e-12)
                params[i], velocities[i] = new_param, new_velocity
    return f"sgd_momentum_step: matches minidist.optim.SGD for {steps} steps, momentum 0 and 0.9"


# ----------------------------------------------------------------------------- exercise 02: prefetching

_DEADLOCK_HINT = ("is the background thread started, and does it put every batch, then an end marker, into "
                  "the queue? If the thread died with an exception, that exception must be put into the "
                  "queue too, or the consumer waits forever")


class _Watchdog:
    """Pull items from an iterator on a helper thread, giving up after ``timeout`` seconds,
    so a learner's deadlock fails a check instead of hanging the notebook."""

    def __init__(self, iterable, what, timeout=WATCHDOG_S):
        self.what, self.timeout = what, timeout
        self.iterator = self._call(lambda: iter(iterable), "iter(loader) did not return")

    def _call(self, fn, problem):
        box = {}

        def run():
            try:
                box["value"] = fn()
            except BaseException as error:  # handed to the caller below
                box["error"] = error

        helper = threading.Thread(target=run, name="training-checks-watchdog", daemon=True)
        helper.start()
        helper.join(self.timeout)
        if helper.is_alive():
            fail(self.what, f"{problem} within {self.timeout:g} s", _DEADLOCK_HINT)
        if isinstance(box.get("error"), NotImplementedError):  # a stub says so (others: the check decides)
            raise checks.learner_error(self.what, box["error"]) from None
        if "error" in box:
            raise box["error"]
        return box["value"]

    def next(self):
        """The next item, or the sentinel ``_Watchdog.DONE`` at the end of the iteration."""
        def pull():
            try:
                return next(self.iterator)
            except StopIteration:
                return _Watchdog.DONE

        return self._call(pull, "no batch (and no end of data) arrived")

    DONE = object()


class _CountingLoader:
    """Yields 0, 1, ..., n-1 and counts how many it has handed out."""

    def __init__(self, n):
        self.n, self.produced = n, 0

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            self.produced += 1
            yield i


class _FailingLoader:
    """Yields 0, 1, 2, then raises ValueError, as a loader that meets a corrupt file."""

    def __iter__(self):
        yield from range(3)
        raise ValueError("corrupt record in batch 3")


def _drain(watchdog, limit=10_000):
    items = []
    while len(items) < limit:
        item = watchdog.next()
        if item is _Watchdog.DONE:
            return items
        items.append(item)
    fail(watchdog.what, f"more than {limit} batches from a finite loader",
                 "stop when the producer signals the end of the data")


def _settle(counter, seconds=3.0):
    """Wait until ``counter.produced`` stops changing (or ``seconds`` pass); return it."""
    before, deadline = -1, time.perf_counter() + seconds
    while counter.produced != before and time.perf_counter() < deadline:
        before = counter.produced
        time.sleep(0.2)
    return counter.produced


def check_prefetch_loader(loader_class) -> str:
    """Check ``loader_class(loader, depth)`` against ``minidist.data.PrefetchLoader``.

    1. Same batches, same order: two epochs over a shuffled ``DataLoader`` of the digits
       (both loaders wrap their own, identically seeded ``DataLoader``).
    2. Look-ahead: while the consumer holds its first batch, the inner loader must have handed
       out at least ``depth + 1`` batches (the prefetching happens) and at most ``depth + 2``
       (the queue is bounded: ``depth`` waiting, one in the producer's hands), for depth 1 and
       3; then the remaining batches arrive in order and the iteration ends.
    3. Errors: a loader that raises after three batches gives those three batches, then the
       same exception (type and message) in the caller.

    Returns a one-line verdict; raises AssertionError with a hint.
    """
    check_own_code(loader_class, "the prefetching loader",
                   methods=("__init__", "__iter__", "__next__"))
    _check_same_batches(loader_class)
    for depth in (1, 3):
        _check_look_ahead(loader_class, depth)
    _check_error_forwarded(loader_class)
    return (f"{loader_class.__name__}: same batches as minidist.data.PrefetchLoader, bounded look-ahead, "
            "errors re-raised")


def _check_same_batches(loader_class) -> None:
    """Part 1 of :func:`check_prefetch_loader`: two epochs, the same batches in the same order."""
    digits = data.load_digits(seed=0)
    what = f"{loader_class.__name__}: batches"
    epochs = []
    for make in (lambda inner: data.PrefetchLoader(inner, depth=2), lambda inner: loader_class(inner, depth=2)):
        inner = data.DataLoader(digits.X_train, digits.y_train, batch_size=100, seed=7)
        loader = make(inner)
        epochs.append([_drain(_Watchdog(loader, what)) for _ in range(2)])
    (expected, got) = epochs
    for epoch, (want, have) in enumerate(zip(expected, got)):
        label = f"{what} of epoch {epoch}"
        if len(have) != len(want):
            fail(label, f"expected {len(want)} batches, got {len(have)}",
                 "pass on every batch of the wrapped loader exactly once, then stop")
        for k, (w, h) in enumerate(zip(want, have)):
            if not (isinstance(h, tuple) and len(h) == 2 and all(np.array_equal(a, b) for a, b in zip(w, h))):
                fail(f"{label}, batch {k}", "differs from the wrapped loader's batch",
                     "yield the batches unchanged and in the order the wrapped loader produced them; "
                     "iterate the wrapped loader afresh on every call of __iter__ (one epoch each)")


def _check_look_ahead(loader_class, depth: int) -> None:
    """Part 2 of :func:`check_prefetch_loader`: between depth + 1 and depth + 2 batches loaded
    while the consumer holds the first; then the rest, in order."""
    label = f"{loader_class.__name__}(depth={depth}) look-ahead"
    counter = _CountingLoader(12)
    watchdog = _Watchdog(loader_class(counter, depth=depth), label)
    first = watchdog.next()
    if first != 0:
        fail(label, f"the first batch should be 0, got {first!r}", "yield batches in order")
    loaded = _settle(counter)
    if loaded < depth + 1:
        fail(label, f"while the consumer held batch 0, only {loaded} batch(es) had been loaded; "
                    f"expected at least {depth + 1}",
             "load in a background thread that keeps filling the queue while the consumer works; "
             "iterating the wrapped loader in __iter__ itself does not prefetch")
    if loaded > depth + 2:
        fail(label, f"while the consumer held batch 0, {loaded} batches had been loaded; "
                    f"at most {depth + 2} are allowed (depth={depth} waiting, one in the producer's hands)",
             "use queue.Queue(maxsize=depth): put() then blocks while the queue is full")
    rest = _drain(watchdog)
    if [first, *rest] != list(range(12)):
        fail(label, f"got {[first, *rest]}, expected {list(range(12))}", "every batch once, in order, then stop")


def _check_error_forwarded(loader_class) -> None:
    """Part 3 of :func:`check_prefetch_loader`: a loader that raises after three batches gives
    those three, then the same exception in the consumer."""
    label = f"{loader_class.__name__} with a loader that fails at batch 3"
    watchdog = _Watchdog(loader_class(_FailingLoader(), depth=2), label)
    received = []
    lost = ("catch the exception in the producer thread, put it in the queue, and raise it in the consumer when it "
            "comes out")
    try:
        while True:
            item = watchdog.next()
            if item is _Watchdog.DONE:
                break
            received.append(item)
    except ValueError as error:
        if received != [0, 1, 2]:
            fail(label, f"batches before the error were {received}, expected [0, 1, 2]",
                 "hand over every batch that was loaded before the error, then raise it")
        if str(error) != "corrupt record in batch 3":
            fail(label, f"the ValueError says {str(error)!r}, expected 'corrupt record in batch 3'",
                 "raise the loader's own exception object, not a new one")
        return
    except AssertionError:
        raise
    except BaseException as error:
        fail(label, f"expected the loader's ValueError, got {type(error).__name__}: {error}", lost)
    fail(label, f"the iteration ended normally after {received}; the loader's ValueError was lost", lost)

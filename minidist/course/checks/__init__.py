"""The checks that exercises call: messages with hints, gradient checks.

Every check raises ``AssertionError`` with a message a learner can act on: what was
checked, what was expected, what came out, and a hint. Because the checks run every time
the notebook runs, a wrong answer saved in a notebook still fails when nbval re-runs it.

In an exercise::

    from minidist.course import checks
    checks.check_close(mean([1, 2, 3]), 2.0, "mean([1, 2, 3])",
                       hint="add the values up and divide by how many there are")
    checks.check_gradient(lambda x: x.sigmoid(), [np.linspace(-2, 2, 5)], what="sigmoid")

One module per topic holds the checks of its exercises: ``checks.collectives`` (03, 04),
``checks.training`` (01, 02), ``checks.parallel`` (05, 06). ``python -m minidist check NN``
(:mod:`minidist.course.runner`) runs an exercise as the grader does.
"""
from __future__ import annotations

import numpy as np

from minidist import backend
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
    input gets no gradient, a gradient of the wrong shape, or wrong values.
    """
    arrays = [np.array(_as_numpy(x), dtype=np.float64) for x in inputs]
    leaves = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    out = fn(*leaves)
    shape = np.shape(out.data)
    # A scalar (a loss) keeps the cotangent 1, so the messages show its plain gradient.
    cotangent = np.ones(shape) if np.size(out.data) == 1 else np.random.default_rng(seed).standard_normal(shape)
    out.backward(cotangent)

    def contracted(xs):
        with no_grad():
            return float((_as_numpy(fn(*[Tensor(x.copy()) for x in xs])) * cotangent).sum())

    numeric = numerical_gradient(contracted, arrays, eps)
    hint = hint or ("compare your backward with the derivative of your forward, term by term; where an "
                    "input is used twice, its gradients must be added; where it was broadcast, summed back")
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



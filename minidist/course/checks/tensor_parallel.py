"""The checks of exercise 14: the ``g`` operator of tensor parallelism and a row-parallel Linear.

1. :func:`check_reduce_from` takes your ``ReduceFrom``, a ``Function`` whose forward sums its
   input over the ranks of ``comm`` (one all-reduce) and whose backward passes the gradient on
   unchanged (Megatron-LM's ``reduce_from_tensor_model_parallel_region``; Shoeybi et al. 2019,
   section 3). On simulated worlds of 1 to 4 ranks, each rank holding a different float64 array
   of shape :data:`SHAPE`, it checks on every rank:

   - the forward: the sum of every rank's array (to 1e-12), against NumPy;
   - the backward: given the same output gradient on every rank (what a layer after ``g`` sees,
     since every rank computes the same thing from the same sum), the input's gradient is that
     gradient unchanged;
   - the messages, counted by a :class:`minidist.tracing.CountingComm`: the forward sends what
     one all-reduce of the array sends (any of ``minidist.collectives.all_reduce``'s
     algorithms), the backward sends nothing.

2. :func:`check_row_parallel_linear` takes your ``RowParallelLinear`` class, built as
   ``RowParallelLinear(dense, comm)`` from a dense ``nn.Linear`` (every rank the same one),
   holding the block ``start:stop`` of the dense weight's *input* columns
   (``chunk_bounds(in_features, T)[rank]``, numpy.array_split's cut) and the whole bias (checked:
   its weight's shape and its bias's values), and
   called on this rank's features of the input, (..., stop - start). Dense layers of 7 and
   of 5 input features (the second without a bias) on 1 to 4 ranks: sizes the number of ranks
   does not divide. On every rank: the output equals the dense layer's (to 1e-12), and, after a
   backward with the same output gradient on every rank, this rank's weight gradient is its
   block of the dense one's, the bias's gradient the dense one's whole, the input's gradient
   the dense input gradient's block; the messages: one all-reduce of the (B, T, out) output
   forward, nothing backward.

Every rank's answer must come from what it received: the inputs are drawn afresh at every call
(no rank can draw another's again from a seed), and on 2 to 4 ranks the forward runs once more
with every message spoiled in transit (:func:`minidist.course.checks.crossing.check_received`): a
rank with a value of its output still right did not depend on what it received (an array passed
through memory the simulated ranks share, which under mpiexec is not there), and fails.

Known mistakes get their hint: the forward's input returned unchanged (no all-reduce), the
mean instead of the sum, the gradient all-reduced in the backward too (T times too large),
two all-reduces, the bias added on every rank before the sum (T times the bias), the bias
divided by T (the right output, but each rank's copy then gets the whole bias's gradient), the
dense weight's rows taken instead of its columns, the partial products not summed.

The engine's own ``ReduceFromTensorParallelRegion``, ``reduce_from_tensor_parallel_region``
and ``RowParallelLinear`` (with its fused product and sum, ``LinearReduce``) may not be the
answer, nor be called by it; ``minidist.collectives.
all_reduce`` may (the exercise is the operator, not the all-reduce: chapter 04 built that).
Each failure raises ``AssertionError("what: problem\\nHint: ...")`` on every rank (the ranks
agree first: :func:`minidist.course.checks.fail_together`); your code raising gives a
:class:`minidist.course.checks.LearnerError` with your line. On success each returns one
verdict line per world size::

    from minidist.course.checks import tensor_parallel as tp_checks
    print(tp_checks.check_reduce_from(ReduceFrom))
    print(tp_checks.check_row_parallel_linear(RowParallelLinear))
"""
from __future__ import annotations

import secrets

import numpy as np

from minidist import nn, sim
from minidist.collectives import ALL_REDUCE_ALGORITHMS, all_reduce, chunk_bounds
from minidist.course.checks import (
    DEADLOCK_HINT,
    call_learner,
    check_own_code,
    fail,
    fail_together,
    forbidding,
)
from minidist.course.checks.crossing import any_right, check_received
from minidist.parallel.tensor_parallel import layers, operators
from minidist.tensor import Tensor
from minidist.tracing import CountingComm

WORLD_SIZES = (1, 2, 3, 4)
SHAPE = (2, 3, 5)  # what g sums in check_reduce_from
BATCH, TOKENS = 2, 3  # the row-parallel layer's input: (BATCH, TOKENS, in_features)
LAYERS = ((7, 5, True), (5, 4, False))  # (in_features, out_features, bias): 2, 3 and 4 divide neither 7 nor 5
ATOL = 1e-12

HINTS = {
    "identity": ("g's forward must sum the ranks' arrays: return all_reduce(comm, x) (minidist.collectives), "
                 "not x itself; each rank holds a partial sum, and only the all-reduce makes it whole"),
    "mean": "g sums, it does not average: all_reduce(comm, x) with op 'sum', nothing divided by the number of ranks",
    "forward": "forward(ctx, x, *, comm) returns all_reduce(comm, x): the elementwise sum of every rank's x",
    "double": ("g's backward is the identity: return (grad,) unchanged. Every rank already holds the whole "
               "output gradient (each computed the same thing from the same sum), and the sum's derivative "
               "with respect to each addend is 1; all-reducing it again counts it once per rank"),
    "backward": "backward(ctx, grad) returns (grad,): the gradient of a sum reaches every addend unchanged",
    "silent": ("the forward sent no message: sum with minidist.collectives.all_reduce(comm, x), which talks "
               "through comm's Send and Recv (MPI's own comm.Allreduce is not counted, and the exercise's "
               "world does not provide it)"),
    "twice": "all-reduce once in the forward: one call of all_reduce(comm, x), whose result you return",
    "backward_sent": ("g's backward sends nothing: return (grad,) as it came; the all-reduce of the backward "
                      "belongs to f, the operator before a column-parallel layer"),
    "bias_every_rank": ("the bias was added on every rank before the sum, so the output holds it T times: sum "
                        "the partial products first (your g), then add the whole bias once"),
    "bias_divided": ("keep the dense layer's whole bias on every rank, a copy of dense.bias.data, and add it once, "
                     "after the sum: a bias divided by T and added before the sum gives the right output, but each "
                     "rank's copy gets the whole bias's gradient, so an optimizer step moves their sum T times too "
                     "far"),
    "rows": ("this rank holds the dense weight's input *columns* start:stop, dense.weight.data[:, start:stop] "
             "(shape (out_features, stop - start)), not its rows: the input it reads is the block of features a "
             "column-parallel layer left on this rank"),
    "no_reduce": ("each rank's product is a partial sum of the output (its block of input features only): "
                  "pass it through your g, ReduceFrom.apply(partial, comm=self.comm), before adding the bias"),
    "row_values": ("out = g(x @ weight.T) + bias, with weight = dense.weight.data[:, start:stop] (a copy) and the "
                   "whole dense bias"),
    "grads": ("the weight's gradient is this rank's block of the dense one's, dense_grad[:, start:stop]; the "
              "bias's is the dense bias's gradient, whole: keep the bias a Parameter and add it once after g"),
}


def _one_all_reduce_counts(comm, n: int) -> dict[str, int]:
    """{algorithm: the elements this rank sends in one all-reduce of n float64 values}, for
    each of ``minidist.collectives.all_reduce``'s algorithms. Collective."""
    counts = {}
    for algorithm in ALL_REDUCE_ALGORITHMS:
        counted = CountingComm(comm, allow_collectives=True)
        all_reduce(counted, np.zeros(n), algorithm=algorithm)
        counts[algorithm] = counted.elements
    return counts


def _traffic_problem(what, counted_forward: int, counted_backward: int, reference: dict[str, int], p: int):
    """The problem with what one rank sent (elements forward, elements backward), or None."""
    if p == 1:
        if counted_backward:
            return what, f"the backward sent {counted_backward} values on a world of one rank", HINTS["backward_sent"]
        return None
    if counted_forward == 0:
        return what, "the forward sent no message", HINTS["silent"]
    if counted_forward not in reference.values():
        doubled = counted_forward in {2 * n for n in reference.values()}
        return (what, f"the forward sent {counted_forward} values; one all-reduce sends "
                      f"{' or '.join(str(n) for n in sorted(set(reference.values())))} (by algorithm)",
                HINTS["twice"] if doubled else HINTS["forward"])
    if counted_backward:
        return what, f"the backward sent {counted_backward} values, expected none", HINTS["backward_sent"]
    return None


def _inputs(rank: int, shape, salt: int) -> np.ndarray:
    """Rank ``rank``'s array, from ``salt`` (drawn at every check: no rank can draw another's)."""
    return np.random.default_rng([salt, 100 + rank]).standard_normal(shape)


def _reduce_from_rank(comm, ReduceFrom, salt):
    p, rank = comm.Get_size(), comm.Get_rank()
    what = f"ReduceFrom.apply(x, comm=comm) on {p} rank{'s' * (p > 1)} (x of shape {SHAPE}, float64, one per rank)"
    reference = _one_all_reduce_counts(comm, int(np.prod(SHAPE)))
    xs = [_inputs(r, SHAPE, salt) for r in range(p)]
    dy = np.random.default_rng(7).standard_normal(SHAPE)  # the same on every rank
    counted = CountingComm(comm, allow_collectives=True)
    x = Tensor(xs[rank].copy(), requires_grad=True)
    y = call_learner(what, ReduceFrom.apply, x, comm=counted, name="your ReduceFrom.forward")
    forward = counted.elements
    problem = None
    if not isinstance(y, Tensor) or tuple(y.shape) != SHAPE:
        problem = (what, f"expected a Tensor of shape {SHAPE}, got {type(y).__name__} "
                         f"{getattr(y, 'shape', '')}", HINTS["forward"])
    else:
        got, total = np.asarray(y.data, dtype=np.float64), np.sum(xs, axis=0)
        if not np.allclose(got, total, rtol=0, atol=ATOL):
            key = ("identity" if np.allclose(got, xs[rank], atol=ATOL) else
                   "mean" if np.allclose(got, total / p, atol=ATOL) else "forward")
            problem = (what, f"the output differs from the sum of the ranks' arrays by up to "
                             f"{float(np.max(np.abs(got - total))):.3g}", HINTS[key])
    fail_together(comm, problem)
    call_learner(what + ", backward", y.backward, dy, name="your ReduceFrom.backward")
    backward = counted.elements - forward
    if x.grad is None or np.shape(x.grad) != SHAPE:
        problem = (what + ", backward", f"expected a gradient of shape {SHAPE} for x, got "
                                        f"{None if x.grad is None else np.shape(x.grad)}", HINTS["backward"])
    elif not np.allclose(x.grad, dy, rtol=0, atol=ATOL):
        key = "double" if np.allclose(x.grad, p * dy, atol=ATOL) else "backward"
        problem = (what + ", backward", f"x's gradient differs from the output's gradient by up to "
                                        f"{float(np.max(np.abs(x.grad - dy))):.3g}", HINTS[key])
    else:
        problem = _traffic_problem(what, forward, backward, reference, p)
    fail_together(comm, problem)
    return f"the sum on every rank, gradient passed on, {forward} values sent forward and {backward} backward"


def _reduce_from_still_right(comm, ReduceFrom, salt) -> bool:
    """The forward of :func:`_reduce_from_rank` again (``comm`` spoils what it delivers): is any
    value of this rank's output still the sum's?"""
    p, rank = comm.Get_size(), comm.Get_rank()
    xs = [_inputs(r, SHAPE, salt) for r in range(p)]
    y = ReduceFrom.apply(Tensor(xs[rank].copy(), requires_grad=True), comm=CountingComm(comm, allow_collectives=True))
    return isinstance(y, Tensor) and any_right(y.data, np.sum(xs, axis=0), ATOL)


def _held_problem(what, layer, dense, start, stop, p):
    """The problem with what your layer holds (its weight's shape, its bias), or None."""
    weight, (out_features, in_features) = getattr(layer, "weight", None), dense.weight.shape
    if not isinstance(weight, Tensor):
        return what, "the layer has no weight Parameter", "self.weight = nn.Parameter(...) in __init__"
    if tuple(weight.shape) != (out_features, stop - start):
        rows = tuple(weight.shape) == (stop - start, in_features) or (
            weight.shape[-1:] == (in_features,) and weight.shape[0] != out_features)
        return (what, f"this rank (input features {start}:{stop}) holds a weight of shape {tuple(weight.shape)}, "
                      f"expected {(out_features, stop - start)}", HINTS["rows"] if rows else HINTS["row_values"])
    if dense.bias is None:
        return None
    mine, whole = getattr(layer, "bias", None), dense.bias.data
    held = mine.data if isinstance(mine, Tensor) else None
    if held is not None and np.shape(held) == whole.shape and np.allclose(held, whole, rtol=0, atol=ATOL):
        return None
    divided = held is not None and np.shape(held) == whole.shape and np.allclose(held, whole / p, atol=ATOL)
    return (what, "the layer's bias is not the dense layer's whole bias", HINTS["bias_divided"] if divided
            else "self.bias = nn.Parameter(dense.bias.data.copy()): the whole bias, on every rank")


def _output_problem(what, y, x, dense, expected, start, stop, p):
    """The problem with your layer's output y for this rank's features start:stop of x, or None."""
    if not isinstance(y, Tensor) or tuple(y.shape) != expected.shape:
        return (what, f"expected an output Tensor of shape {expected.shape}, got {type(y).__name__} "
                      f"{getattr(y, 'shape', '')}", HINTS["row_values"])
    got = np.asarray(y.data, dtype=np.float64)
    if np.allclose(got, expected, rtol=0, atol=ATOL):
        return None
    partial = x[..., start:stop] @ dense.weight.data[:, start:stop].T  # this rank's term, not summed
    b = 0.0 if dense.bias is None else dense.bias.data
    key = ("bias_every_rank" if dense.bias is not None and np.allclose(got, expected + (p - 1) * b, atol=1e-10) else
           "no_reduce" if np.allclose(got, partial + b, atol=1e-10) else "row_values")
    return what, f"the output differs from the dense layer's by up to {float(np.max(np.abs(got - expected))):.3g}", \
        HINTS[key]


def _gradient_problem(what, grads, p):
    """The problem with the gradients [(name, yours, the dense layer's)], or None."""
    for name, got, want in grads:
        if got is None or np.shape(got) != want.shape:
            hint = HINTS["grads"] if name != "input" else HINTS["backward"]
            shape = None if got is None else np.shape(got)
            return what, f"the {name}'s gradient has shape {shape}, expected {want.shape}", hint
        if not np.allclose(got, want, rtol=0, atol=1e-10):
            key = "double" if np.allclose(got, p * want, atol=1e-10) else "grads"
            return (what, f"the {name}'s gradient differs from the dense layer's {'block ' if name != 'bias' else ''}"
                          f"by up to {float(np.max(np.abs(got - want))):.3g}", HINTS[key])
    return None


def _row_parallel_inputs(in_features, out_features, salt):
    """(x, dy) of the row-parallel check, from ``salt`` (drawn at every check)."""
    return (np.random.default_rng([salt, 5]).standard_normal((BATCH, TOKENS, in_features)),
            np.random.default_rng([salt, 6]).standard_normal((BATCH, TOKENS, out_features)))


def _row_parallel_rank(comm, RowParallelLinear, salt):
    p, rank = comm.Get_size(), comm.Get_rank()
    verdicts = []
    for in_features, out_features, bias in LAYERS:
        what = (f"RowParallelLinear(dense, comm) of an nn.Linear({in_features}, {out_features}, bias={bias}) on {p} "
                f"rank{'s' * (p > 1)} (float64)")
        start, stop = chunk_bounds(in_features, p)[rank]
        dense = nn.Linear(in_features, out_features, bias, rng=3, dtype="float64")
        x, dy = _row_parallel_inputs(in_features, out_features, salt)
        x_dense = Tensor(x.copy(), requires_grad=True)
        y_dense = dense(x_dense)
        y_dense.backward(dy)
        reference = _one_all_reduce_counts(comm, BATCH * TOKENS * out_features)

        counted = CountingComm(comm, allow_collectives=True)
        layer = call_learner(what, RowParallelLinear, dense, counted, name="your RowParallelLinear.__init__")
        fail_together(comm, _held_problem(what, layer, dense, start, stop, p))
        x_mine = Tensor(x[..., start:stop].copy(), requires_grad=True)
        y = call_learner(what, layer, x_mine, name="your RowParallelLinear.forward")
        forward = counted.elements
        fail_together(comm, _output_problem(what, y, x, dense, y_dense.data, start, stop, p))

        call_learner(what + ", backward", y.backward, dy, name="your RowParallelLinear's backward")
        backward = counted.elements - forward
        grads = [("weight", getattr(layer.weight, "grad", None), dense.weight.grad[:, start:stop]),
                 ("input", x_mine.grad, x_dense.grad[..., start:stop])]
        if bias:
            grads.append(("bias", getattr(getattr(layer, "bias", None), "grad", None), dense.bias.grad))
        problem = _gradient_problem(what + ", backward", grads, p)
        fail_together(comm, problem or _traffic_problem(what, forward, backward, reference, p))
        verdicts.append(f"{in_features}->{out_features}: features {start}:{stop}")
    return "equal to the dense layers, one all-reduce forward, none backward (" + "; ".join(verdicts) + ")"


def _row_parallel_still_right(comm, RowParallelLinear, salt) -> bool:
    """The forwards of :func:`_row_parallel_rank` again (``comm`` spoils what it delivers): is
    any value of this rank's output of some layer still the dense one's?"""
    p, rank = comm.Get_size(), comm.Get_rank()
    for in_features, out_features, bias in LAYERS:
        start, stop = chunk_bounds(in_features, p)[rank]
        dense = nn.Linear(in_features, out_features, bias, rng=3, dtype="float64")
        x, _ = _row_parallel_inputs(in_features, out_features, salt)
        expected = dense(Tensor(x.copy())).data
        y = RowParallelLinear(dense, CountingComm(comm, allow_collectives=True))(
            Tensor(x[..., start:stop].copy(), requires_grad=True))
        if isinstance(y, Tensor) and any_right(y.data, expected, ATOL):
            return True
    return False


def _on_sim(check, still_right, fn, name: str) -> str:
    lines = []
    salt = secrets.randbits(64)  # the inputs: new at every call
    for p in WORLD_SIZES:
        try:
            verdicts = sim.World(p, timeout=60).run(check, fn, salt)
        except (sim.DeadlockError, sim.SimTimeoutError) as error:
            fail(f"{name} on {p} simulated ranks", str(error), DEADLOCK_HINT)
        check_received(f"{name} on {p} simulated ranks", p, still_right, fn, salt)
        lines.append(f"p={p}: {verdicts[0]}")
    return f"{name}: ok\n" + "\n".join(lines)


_ENGINE = (operators.ReduceFromTensorParallelRegion.forward, operators.ReduceFromTensorParallelRegion.backward,
           operators.reduce_from_tensor_parallel_region, layers.RowParallelLinear.forward,
           layers.RowParallelLinear.from_dense,
           # the engine's row-parallel product fused with g, where it has one
           *(f for f in (getattr(getattr(layers, "LinearReduce", None), "forward", None),) if f is not None))


@forbidding(*_ENGINE)
def check_reduce_from(ReduceFrom) -> str:
    """Check your ``g`` (module docstring, part 1): ``ReduceFrom.apply(x, comm=comm)``."""
    check_own_code(ReduceFrom, "ReduceFrom", methods=("forward", "backward"))
    return _on_sim(_reduce_from_rank, _reduce_from_still_right, ReduceFrom, "ReduceFrom")


@forbidding(*_ENGINE)
def check_row_parallel_linear(RowParallelLinear) -> str:
    """Check your ``RowParallelLinear(dense, comm)`` (module docstring, part 2)."""
    check_own_code(RowParallelLinear, "RowParallelLinear", methods=("__init__", "forward", "from_dense"))
    return _on_sim(_row_parallel_rank, _row_parallel_still_right, RowParallelLinear, "RowParallelLinear")


__all__ = ["HINTS", "LAYERS", "SHAPE", "WORLD_SIZES", "check_reduce_from", "check_row_parallel_linear"]

"""minidist.course.checks.tensor_parallel (exercise 14): the solution's g and row-parallel Linear
pass on 1 to 4 simulated ranks; versions wrong in each way the checks look for fail, each with
its own hint; the engine's own g, RowParallelLinear and fused product-and-sum are refused as
the answer and when called by it; a stub says it is one."""
import numpy as np
import pytest

from minidist import nn
from minidist.collectives import all_reduce, chunk_bounds
from minidist.course.checks import STUB_HINT, LearnerError
from minidist.course.checks import tensor_parallel as tp_checks
from minidist.parallel.tensor_parallel import layers, operators
from minidist.tensor import Function

OWN = "own implementation, not yours"


def reduce_from(forward=lambda comm, x: all_reduce(comm, x), backward=lambda comm, grad: grad):
    """The exercise's g, with its forward or its backward replaceable."""

    class ReduceFrom(Function):
        @staticmethod
        def forward(ctx, x, *, comm):
            ctx.comm = comm
            return forward(comm, x)

        @staticmethod
        def backward(ctx, grad):
            return (backward(ctx.comm, grad),)

    return ReduceFrom


GOOD = reduce_from()


def row_parallel(mistake=None, g=GOOD):
    """The exercise's RowParallelLinear, the solution's or with one mistake."""

    class RowParallelLinear(nn.Module):
        def __init__(self, dense, comm):
            super().__init__()
            self.comm, p = comm, comm.Get_size()
            self.start, self.stop = chunk_bounds(dense.in_features, p)[comm.Get_rank()]
            rows = mistake == "rows"
            self.weight = nn.Parameter((dense.weight.data[self.start:self.stop] if rows else
                                        dense.weight.data[:, self.start:self.stop]).copy())
            bias = None if dense.bias is None else dense.bias.data.copy()
            if bias is not None and mistake == "divided":
                bias = bias / p
            self.bias = None if bias is None else nn.Parameter(bias)

        def forward(self, x):
            partial = x @ self.weight.transpose(1, 0)
            if mistake in ("every_rank", "divided"):  # the bias inside the sum
                return g.apply(partial if self.bias is None else partial + self.bias, comm=self.comm)
            if mistake == "engine_fused":
                out = layers.LinearReduce.apply(x, self.weight, comm=self.comm, sequence_parallel=False)
            elif mistake == "engine_g":
                out = operators.reduce_from_tensor_parallel_region(partial, self.comm)
            else:
                out = partial if mistake == "no_reduce" else g.apply(partial, comm=self.comm)
            return out if self.bias is None else out + self.bias

    return RowParallelLinear


def test_the_solution_passes_on_one_to_four_ranks():
    verdict = tp_checks.check_reduce_from(GOOD)
    assert verdict.startswith("ReduceFrom: ok") and all(f"p={p}:" in verdict for p in (1, 2, 3, 4))
    assert "p=2: the sum on every rank, gradient passed on, 30 values sent forward and 0 backward" in verdict
    verdict = tp_checks.check_row_parallel_linear(row_parallel())
    assert verdict.startswith("RowParallelLinear: ok")
    assert "p=4: equal to the dense layers, one all-reduce forward, none backward (7->5: features 0:2; " \
           "5->4: features 0:2)" in verdict
    assert "p=3:" in verdict and "7->5: features 0:3" in verdict


def other_algorithm(comm, x):
    return all_reduce(comm, x, algorithm="ring")


@pytest.mark.parametrize("g, fragment", [
    (reduce_from(forward=lambda comm, x: x), "not x itself"),
    (reduce_from(forward=lambda comm, x: all_reduce(comm, x) / comm.Get_size()), "it does not average"),
    (reduce_from(backward=lambda comm, grad: all_reduce(comm, grad)), "counts it once per rank"),
    (reduce_from(forward=lambda comm, x: all_reduce(comm, x) + 0 * all_reduce(comm, x)), "all-reduce once"),
    (reduce_from(forward=lambda comm, x: 2 * all_reduce(comm, x)), "the elementwise sum of every rank's x"),
], ids=["identity", "mean", "backward-all-reduced", "two-all-reduces", "twice-the-sum"])
def test_each_mistake_of_g_gets_its_hint(g, fragment):
    with pytest.raises(AssertionError, match="Hint") as failure:
        tp_checks.check_reduce_from(g)
    assert fragment in str(failure.value), str(failure.value)


def test_a_sum_through_mpis_own_collectives_is_not_counted_and_says_so():
    g = reduce_from(forward=lambda comm, x: sum(comm.allgather(x)))  # right values, pickled, uncounted
    with pytest.raises(AssertionError, match="the forward sent no message") as failure:
        tp_checks.check_reduce_from(g)
    assert "minidist.collectives.all_reduce" in str(failure.value)


def test_any_all_reduce_algorithm_is_one_all_reduce():
    assert tp_checks.check_reduce_from(reduce_from(forward=other_algorithm)).startswith("ReduceFrom: ok")


@pytest.mark.parametrize("mistake, fragment", [
    ("every_rank", "the output holds it T times"),
    ("divided", "moves their sum T times too far"),
    ("rows", "not its rows"),
    ("no_reduce", "pass it through your g"),
], ids=["bias-on-every-rank", "bias-divided", "rows-for-columns", "no-sum"])
def test_each_mistake_of_the_row_parallel_layer_gets_its_hint(mistake, fragment):
    with pytest.raises(AssertionError, match="Hint") as failure:
        tp_checks.check_row_parallel_linear(row_parallel(mistake))
    assert fragment in str(failure.value), str(failure.value)


def test_a_wrong_g_inside_the_layer_is_caught_by_its_gradients():
    with pytest.raises(AssertionError, match="counts it once per rank"):
        tp_checks.check_row_parallel_linear(row_parallel(g=reduce_from(backward=lambda c, grad: all_reduce(c, grad))))


def test_the_engines_own_code_is_refused_as_the_answer_and_inside_it():
    with pytest.raises(AssertionError, match=OWN):
        tp_checks.check_reduce_from(operators.ReduceFromTensorParallelRegion)
    with pytest.raises(AssertionError, match=OWN):
        tp_checks.check_row_parallel_linear(layers.RowParallelLinear)
    calls = reduce_from(forward=lambda comm, x: operators.ReduceFromTensorParallelRegion.forward(None, x, comm=comm))
    with pytest.raises(LearnerError, match=OWN):
        tp_checks.check_reduce_from(calls)
    for mistake in ("engine_g", "engine_fused"):
        with pytest.raises(LearnerError, match=OWN):
            tp_checks.check_row_parallel_linear(row_parallel(mistake))

    class Inherits(operators.ReduceFromTensorParallelRegion):
        pass

    with pytest.raises(AssertionError, match="its forward is"):
        tp_checks.check_reduce_from(Inherits)


def test_a_stub_says_it_is_one():
    def stub(comm, x):
        raise NotImplementedError()

    with pytest.raises(LearnerError) as failure:
        tp_checks.check_reduce_from(reduce_from(forward=stub))
    assert STUB_HINT in str(failure.value)


def through_shared_memory():
    """A g whose sum comes through memory the simulated ranks (threads) share, with one
    all-reduce of zeros for the traffic: under mpiexec the dict is the rank's own, and empty."""
    shared = {}

    def forward(comm, x):
        p, rank = comm.Get_size(), comm.Get_rank()
        shared[p, rank] = x.copy()
        all_reduce(comm, np.zeros_like(x))  # the traffic, and a wait for every rank
        return sum(shared[p, r] for r in range(p))

    return reduce_from(forward)


def test_a_sum_that_did_not_come_through_comm_fails():
    """Issue 36: each passed before. A sum through memory the simulated ranks share is still right
    when every message arrives spoiled; the other ranks' inputs drawn again from the check's old
    seeds (100 + rank) no longer are theirs (drawn afresh at every call); the same for the layer."""
    shared = through_shared_memory()
    for check, answer in ((tp_checks.check_reduce_from, shared), (tp_checks.check_row_parallel_linear,
                                                                  row_parallel(g=shared))):
        with pytest.raises(AssertionError) as caught:
            check(answer)
        message = str(caught.value)
        assert "on 2 simulated ranks: with every array message spoiled in transit (NaN arrives), ranks 0, 1 still " \
               "returned right values: they did not depend on what your rank received" in message, message
        assert "under mpiexec each rank is a process of its own" in message

    def redrawn(comm, x):
        all_reduce(comm, np.zeros_like(x))
        return sum(np.random.default_rng(100 + r).standard_normal(x.shape) for r in range(comm.Get_size()))

    with pytest.raises(AssertionError, match="differs from the sum of the ranks' arrays"):
        tp_checks.check_reduce_from(reduce_from(redrawn))

"""minidist.course.checks.sequence_parallel (exercise 14's puzzle): the solution's g and ḡ and its
sequence-parallel block pass on 1 to 4 simulated ranks; each usual wrong turn fails with its own
hint (the LayerNorm's or fc2's bias gradient left unsummed: the ranks' copies drift apart after
a step whose output still matched; averaged instead of summed; an all-reduce and a slice where a
reduce-scatter belongs; the bias added on every rank; the dense block kept whole; the hidden
features cut evenly where T does not divide them); the engine's operators are refused."""
import numpy as np
import pytest

from minidist import functions as F
from minidist import nn
from minidist.collectives import all_gather, all_reduce, chunk_bounds, reduce_scatter
from minidist.course.checks import LearnerError
from minidist.course.checks import sequence_parallel as sp_checks
from minidist.parallel.tensor_parallel import operators
from minidist.tensor import Function

OWN = "own implementation, not yours"


def _to_blocks(comm, x):
    p = comm.Get_size()
    moved = np.ascontiguousarray(np.moveaxis(x, 1, 0))
    mine = reduce_scatter(comm, moved).reshape((x.shape[1] // p,) + moved.shape[1:])
    return np.ascontiguousarray(np.moveaxis(mine, 0, 1))


def _gathered(comm, x):
    return np.concatenate(list(all_gather(comm, np.ascontiguousarray(x))), axis=1)


def _sliced_sum(comm, x):  # an all-reduce and a slice: the right numbers, twice the bytes
    p, rank = comm.Get_size(), comm.Get_rank()
    per = x.shape[1] // p
    return all_reduce(comm, x)[:, rank * per:(rank + 1) * per].copy()


def _own_block(comm, grad):  # this rank's block of its own gradient: the other ranks' parts dropped
    p, rank = comm.Get_size(), comm.Get_rank()
    per = grad.shape[1] // p
    return grad[:, rank * per:(rank + 1) * per].copy()


def operator(forward, backward):
    class Op(Function):
        @staticmethod
        def forward(ctx, x, *, comm):
            ctx.comm = comm
            return forward(comm, x)

        @staticmethod
        def backward(ctx, grad):
            return (backward(ctx.comm, grad),)

    return Op


GATHER = operator(_gathered, _to_blocks)
SCATTER = operator(_to_blocks, _gathered)
SUM = operator(lambda comm, x: x, lambda comm, grad: all_reduce(comm, grad))
MEAN = operator(lambda comm, x: x, lambda comm, grad: all_reduce(comm, grad) / comm.Get_size())
IDENTITY = operator(lambda comm, x: x, lambda comm, grad: grad)


def block(mistake=None, gather=GATHER, scatter=SCATTER):
    """The puzzle's SequenceParallelMLP, the solution's or with one mistake."""
    ln_sum = IDENTITY if mistake == "ln_unsummed" else MEAN if mistake == "mean" else SUM
    bias_sum = IDENTITY if mistake == "bias_unsummed" else SUM

    class SequenceParallelMLP(nn.Module):
        def __init__(self, dense, comm):
            super().__init__()
            self.comm, p = comm, comm.Get_size()
            hidden = dense.fc1.out_features
            self.start, self.stop = chunk_bounds(hidden, p)[comm.Get_rank()]
            if mistake == "even_cut":
                per = hidden // p
                self.start, self.stop = comm.Get_rank() * per, (comm.Get_rank() + 1) * per
            rows = slice(self.start, self.stop)
            self.ln_weight = nn.Parameter(dense.ln.weight.data.copy())
            self.ln_bias = nn.Parameter(dense.ln.bias.data.copy())
            self.fc1_weight = nn.Parameter(dense.fc1.weight.data[rows].copy())
            self.fc1_bias = nn.Parameter(dense.fc1.bias.data[rows].copy())
            self.fc2_weight = nn.Parameter(dense.fc2.weight.data[:, rows].copy())
            self.fc2_bias = nn.Parameter(dense.fc2.bias.data.copy())
            if mistake == "keeps_dense":
                self.dense = dense

        def forward(self, x):
            ln_weight, ln_bias = (ln_sum.apply(q, comm=self.comm) for q in (self.ln_weight, self.ln_bias))
            fc2_bias = bias_sum.apply(self.fc2_bias, comm=self.comm)
            h = gather.apply(F.layer_norm(x, x.shape[-1], ln_weight, ln_bias), comm=self.comm)
            h = F.gelu(h @ self.fc1_weight.transpose(1, 0) + self.fc1_bias, approximate="tanh")
            partial = h @ self.fc2_weight.transpose(1, 0)
            if mistake == "bias_every_rank":
                return x + scatter.apply(partial + fc2_bias, comm=self.comm)
            return x + scatter.apply(partial, comm=self.comm) + fc2_bias

    return SequenceParallelMLP


def test_the_solution_passes_on_one_to_four_ranks():
    verdict = sp_checks.check_sequence_operators(GATHER, SCATTER)
    assert verdict.startswith("GatherSequence and ReduceScatterSequence: ok")
    assert "p=3: blocks of 4 positions, 96 values sent each way" in verdict
    verdict = sp_checks.check_sequence_parallel_mlp(block())
    assert verdict.startswith("SequenceParallelMLP: ok")
    # 4 (T-1) B t/T C = 4 * 2 * 2 * 4 * 6 = 384 on 3 ranks, and three all-reduces of 6 numbers
    assert "p=3: 3 SGD steps equal one process" in verdict and "384 for g and ḡ" in verdict


@pytest.mark.parametrize("gather, scatter, fragment", [
    (operator(lambda comm, x: np.concatenate(list(all_gather(comm, x)), axis=0), _to_blocks), SCATTER,
     "move the rank axis next to the positions"),
    (operator(_gathered, _own_block), SCATTER, "must *sum* the ranks' gradients"),
    (operator(_gathered, _sliced_sum), SCATTER, "sends twice the bytes"),
    (GATHER, operator(_sliced_sum, _gathered), "sends twice the bytes"),
    (GATHER, operator(_to_blocks, lambda comm, grad: np.concatenate([grad] * comm.Get_size(), axis=1)),
     "must gather every rank's block"),
    (GATHER, operator(lambda comm, x: reduce_scatter(comm, x), _gathered), "make the positions the first axis"),
])
def test_each_mistake_of_the_operators_gets_its_hint(gather, scatter, fragment):
    with pytest.raises(AssertionError, match="Hint: ") as caught:
        sp_checks.check_sequence_operators(gather, scatter)
    assert fragment in str(caught.value), str(caught.value)


@pytest.mark.parametrize("mistake, fragment", [
    ("ln_unsummed", "ln.weight differs on the ranks"),
    ("bias_unsummed", "fc2.bias differs on the ranks"),
    ("mean", "was averaged over the ranks"),
    ("bias_every_rank", "holds it T times"),
    ("keeps_dense", "hold only this rank's shard"),
    ("even_cut", "the first hidden % T ranks get one feature more"),
])
def test_each_mistake_of_the_block_gets_its_hint(mistake, fragment):
    with pytest.raises(AssertionError, match="Hint: ") as caught:
        sp_checks.check_sequence_parallel_mlp(block(mistake))
    assert fragment in str(caught.value), str(caught.value)


def test_unsummed_layer_norm_gradients_pass_the_first_step_and_drift_after_it():
    """The trap of the puzzle: the output of step 1 matches; the copies differ after its update."""
    with pytest.raises(AssertionError) as caught:
        sp_checks.check_sequence_parallel_mlp(block("ln_unsummed"))
    assert "step 1 of 3, after the SGD step: ln.weight differs on the ranks" in str(caught.value)


def test_an_all_reduce_inside_the_block_fails_on_its_bytes():
    sliced = operator(_sliced_sum, _gathered)
    with pytest.raises(AssertionError, match="plus the whole parameters' all-reduce"):
        sp_checks.check_sequence_parallel_mlp(block(scatter=sliced))


def test_the_engines_operators_are_refused():
    engine_gather = operator(lambda comm, x: operators.all_gather_sequence(comm, x), _to_blocks)
    with pytest.raises(LearnerError, match=OWN):
        sp_checks.check_sequence_operators(engine_gather, SCATTER)
    with pytest.raises(AssertionError, match=OWN):
        sp_checks.check_sequence_operators(operators.GatherFromSequenceParallelRegion, SCATTER)


def test_gradient_sums_through_shared_memory_fail():
    """The whole parameters' gradient parts added through a dict the simulated ranks' threads share,
    with an all-reduce of zeros for the look of the traffic: values, drift and bytes all right, and
    under mpiexec impossible; the step run with the small messages spoiled catches it."""
    board = {}

    # one entry per sum in call order: every rank calls the sums in the same order
    counter = {}

    def ordered_sum(comm, grad):
        p = comm.Get_size()
        n = counter.setdefault((p, comm.Get_rank()), 0)
        counter[p, comm.Get_rank()] = n + 1
        key = (p, n)
        board.setdefault(key, {})[comm.Get_rank()] = grad.copy()
        all_reduce(comm, np.zeros_like(grad))
        return sum(board[key][r] for r in range(comm.Get_size()))

    shared = operator(lambda comm, x: x, ordered_sum)

    class Cheat(block()):
        def forward(self, x):
            ln_weight, ln_bias, fc2_bias = (shared.apply(q, comm=self.comm)
                                            for q in (self.ln_weight, self.ln_bias, self.fc2_bias))
            h = GATHER.apply(F.layer_norm(x, x.shape[-1], ln_weight, ln_bias), comm=self.comm)
            h = F.gelu(h @ self.fc1_weight.transpose(1, 0) + self.fc1_bias, approximate="tanh")
            return x + SCATTER.apply(h @ self.fc2_weight.transpose(1, 0), comm=self.comm) + fc2_bias

    with pytest.raises(AssertionError, match="the whole parameters' gradients: with every array message spoiled"):
        sp_checks.check_sequence_parallel_mlp(Cheat)

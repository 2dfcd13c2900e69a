"""The puzzle of exercise 14: sequence parallelism's pair of operators, and what else must be
summed (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
MLSys 2023, section 4.2.2).

1. :func:`check_sequence_operators` takes your ``GatherSequence`` and ``ReduceScatterSequence``,
   two ``Function``\\ s applied as ``Op.apply(x, comm=comm)`` along axis 1 of a (B, t, C) array,
   each rank holding the block of t / T positions ``rank * t/T`` to ``(rank + 1) * t/T``:

   - ``GatherSequence`` (Korthikanti et al.'s g, in f's place before a column-parallel layer):
     forward, every rank's block put back together, (B, t/T, C) -> (B, t, C); backward, the
     ranks' gradients (each rank's split layer gives a part of every position's) summed, each
     rank keeping its block: a reduce-scatter;
   - ``ReduceScatterToSequence`` (their ḡ, in g's place after a row-parallel layer): forward,
     the ranks' partial sums added, each rank keeping its block, (B, t, C) -> (B, t/T, C);
     backward, every rank's block of the gradient gathered: an all-gather.

   On 1 to 4 simulated ranks it checks the values on every rank (to 1e-12) and, counted by a
   :class:`minidist.tracing.CountingComm`, what each direction sends: (T-1) B t/T C values,
   one ring all-gather or reduce-scatter (half an all-reduce; an all-reduce and a slice sends
   twice that).

2. :func:`check_sequence_parallel_mlp` takes your ``SequenceParallelMLP(dense, comm)``: the
   residual block ``x + fc2(gelu(fc1(ln(x))))`` of a :class:`ResidualMLP` split over T ranks,
   fc1 column-parallel (its rows ``chunk_bounds(hidden, T)[rank]``, sizes T need not divide),
   fc2 row-parallel, LayerNorm and residual on this rank's positions, called on this rank's
   block (B, t/T, C). The check trains it: :data:`STEPS` steps of plain SGD (lr :data:`LR`)
   that the check takes itself on ``block.parameters()``, the input and the output's gradient
   new at every step, on 1 to 4 ranks, against one process training the dense block on the
   whole sequence. On every rank and every step: the output at this rank's positions equals the
   dense block's (to 1e-10), and so does the input's gradient; after every step each parameter
   equals its part of the dense one's, the same on every rank for the whole ones (the LayerNorm's
   weight and bias, fc2's bias); the block holds no more than its shard's bytes; and each step
   sends 4 (T-1) B t/T C values (g and ḡ, forward and backward) plus the all-reduce of the
   whole parameters' gradients (3 C numbers, fused or not, by any algorithm of
   ``all_reduce``).

The trap: the loss (here, the output) matches at the first step whatever happens to the whole
parameters' gradients, since the step that would spoil them has not been taken yet. Each rank
sees only its positions, so the gradient of LayerNorm's weight and bias and of fc2's bias is a
part; left unsummed, the ranks step by different amounts and their copies drift apart.

Every rank's answer must come from what it received: the inputs are drawn afresh at every call,
and the first forward runs once more with every message spoiled in transit
(:func:`~minidist.course.checks.crossing.check_received`), then the first step with only the
messages of at most 3 C numbers spoiled (the whole parameters' gradient sums): a whole parameter
still right after it did not get the other ranks' parts through the communicator. The engine's sequence-parallel
operators, its f, ``SequenceParallelLayerNorm`` and its parallel Linears may not be the answer
nor be called by it; ``minidist.collectives``' ``all_gather``, ``reduce_scatter`` and
``all_reduce`` may. A failure raises ``AssertionError("what: problem\\nHint: ...")`` on every
rank; your code raising gives a :class:`minidist.course.checks.LearnerError`.

Longer than 400 lines: the puzzle's two checks (the operators, then the block trained three steps)
share the cut of the sequence, the inputs drawn per call and the counting of what was sent; each
hint sits beside the check that gives it. Use::

    from minidist.course.checks import sequence_parallel as sp_checks
    print(sp_checks.check_sequence_operators(GatherSequence, ReduceScatterSequence))
    print(sp_checks.check_sequence_parallel_mlp(SequenceParallelMLP))
"""
from __future__ import annotations

import itertools
import secrets
import sys

import numpy as np

from minidist import collectives, nn, sim
from minidist import functions as F
from minidist.collectives import ALL_REDUCE_ALGORITHMS, all_gather, all_reduce, chunk_bounds
from minidist.course.checks import DEADLOCK_HINT, call_learner, check_own_code, fail, fail_together, forbidding
from minidist.course.checks.crossing import any_right, check_received
from minidist.course.checks.integrity import unchanged
from minidist.parallel.tensor_parallel import gpt as tp_gpt
from minidist.parallel.tensor_parallel import layers, operators
from minidist.tensor import Tensor
from minidist.tracing import CountingComm

WORLD_SIZES = (1, 2, 3, 4)
BATCH, SEQ, EMBD, HIDDEN = 2, 12, 6, 10  # 1..4 divide SEQ; 3 and 4 do not divide HIDDEN
STEPS, LR = 3, 0.05
ATOL = 1e-10

HINTS = {
    "gather_shape": ("GatherSequence's forward puts the ranks' blocks side by side along axis 1, the sequence: "
                     "all_gather(comm, x) gives (T, B, t/T, C); move the rank axis next to the positions "
                     "(np.concatenate(list(parts), axis=1)) to get (B, t, C)"),
    "gather_values": "GatherSequence's forward: rank r's block at positions r*t/T .. (r+1)*t/T, in rank order",
    "gather_backward_sum": ("GatherSequence's backward must *sum* the ranks' gradients before keeping this rank's "
                            "block: each rank's column-parallel layer gave a part of every position's gradient. "
                            "Slicing your own block of your own gradient drops the other ranks' parts"),
    "gather_backward": ("GatherSequence's backward: the sum over the ranks of the gradient, this rank's block of "
                        "positions only, (B, t/T, C): a reduce-scatter along axis 1 (move axis 1 first, "
                        "reduce_scatter the contiguous array, reshape)"),
    "scatter_shape": ("ReduceScatterSequence's forward returns this rank's block of positions of the sum, "
                      "(B, t/T, C): reduce_scatter cuts the flattened array into T chunks, so make the positions "
                      "the first axis before it (np.moveaxis(x, 1, 0), contiguous) and move them back after"),
    "scatter_values": ("ReduceScatterSequence's forward: the sum over the ranks of x, at this rank's positions "
                       "r*t/T .. (r+1)*t/T only"),
    "scatter_backward_own": ("ReduceScatterSequence's backward must gather every rank's block of the gradient: "
                             "each position's partial sums, on every rank, fed that position's output; zeros "
                             "(or this rank's block alone) leave the other positions without a gradient"),
    "scatter_backward": ("ReduceScatterSequence's backward: every rank's block of the gradient, put together "
                         "along axis 1 to (B, t, C): an all-gather"),
    "all_reduce": ("an all-reduce and a slice gives the right numbers but sends twice the bytes: a reduce-scatter "
                   "sends (T-1)/T of the array and leaves each rank only the positions it keeps, which is all "
                   "sequence parallelism needs (and the whole point: the same bytes as tensor parallelism alone)"),
    "bytes": ("one ring collective per direction, from minidist.collectives: all_gather forward and reduce_scatter "
              "backward for GatherSequence, the other way round for ReduceScatterSequence"),
    "silent": ("nothing was sent: use minidist.collectives' all_gather, reduce_scatter and all_reduce, which talk "
               "through comm's Send and Recv (MPI's own Allgather is not counted)"),
    # the block
    "block_values": ("out = x + ḡ(fc2 partial product) + fc2's bias, with h = gelu(fc1 rows block of "
                     "GatherSequence(ln(x))): LayerNorm on this rank's positions, g before fc1, ḡ after fc2, the "
                     "residual added to this rank's positions"),
    "bias_every_rank": ("fc2's bias went into the sum on every rank, so the output holds it T times: add it once, "
                        "after ReduceScatterSequence, to this rank's positions"),
    "held": ("hold only this rank's shard: fc1's rows start:stop (weight and bias), fc2's columns start:stop, "
             "and the whole LayerNorm weight and bias and fc2 bias (copies, as nn.Parameter); the check steps "
             "every Parameter of the block, so every number the block learns must be one"),
    "uneven": ("this rank's hidden features are start:stop = chunk_bounds(hidden, T)[rank] (given in __init__): "
               "numpy.array_split's cut, where the first hidden % T ranks get one feature more; a cut of hidden // T "
               "each leaves features out when T does not divide hidden (10 here)"),
    "drift": ("{name} is whole on every rank, but each rank sees only its positions, so its gradient on each "
              "rank is a part: sum the parts over the ranks before the step (an f on it in the forward: the "
              "identity, with an all_reduce of the gradient backward), or the copies drift apart"),
    "mean": ("{name}'s gradient was averaged over the ranks: the parts are of one sum over every position, so "
             "add them (all_reduce's default 'sum'), do not divide by T"),
    "sharded": ("{name} is this rank's shard; its gradient is wrong: check GatherSequence's backward (the parts "
                "of the input's gradient summed) and ReduceScatterSequence's backward (every position's gradient "
                "gathered)"),
    "input_grad": ("the input's gradient at this rank's positions must be the dense block's: the residual's, "
                   "plus LayerNorm's from GatherSequence's backward (the ranks' parts summed, this block kept)"),
    "block_bytes": ("per step: g and ḡ forward, their mirror images backward, (T-1) B t/T C values each, and one "
                    "all_reduce of each whole parameter's gradient ({extra}); nothing more"),
    "sums_received": ("sum the whole parameters' gradients through comm (all_reduce of each, or of them laid end to "
                      "end): every simulated rank is a thread of this one process, but under mpiexec each rank is a "
                      "process of its own, and another rank's gradient left in memory they share is not there"),
    "gather_twice": ("more than the formula: did you all_reduce where a reduce-scatter or an all-gather belongs, "
                     "or gather fc1's input again? Keep the gathered input (the engine's autodiff holds it for "
                     "fc1's backward anyway)"),
}
ENGINE = "the engine's own implementation, not yours"


class ResidualMLP(nn.Module):
    """The dense block of the puzzle: ``x + fc2(gelu(fc1(ln(x))))`` on (B, t, C), float64:
    ``ln`` a LayerNorm(C), ``fc1`` Linear(C, hidden), ``fc2`` Linear(hidden, C); GELU's tanh
    form (GPT-2's). The LayerNorm's weight and bias are drawn, not ones and zeros."""

    def __init__(self, embd: int = EMBD, hidden: int = HIDDEN, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.ln = nn.LayerNorm(embd, dtype="float64")
        self.ln.weight.data[...] = 1 + 0.3 * rng.standard_normal(embd)
        self.ln.bias.data[...] = 0.3 * rng.standard_normal(embd)
        self.fc1 = nn.Linear(embd, hidden, rng=rng, dtype="float64")
        self.fc2 = nn.Linear(hidden, embd, rng=rng, dtype="float64")
        self.fc2.bias.data[...] = 0.3 * rng.standard_normal(embd)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x)), approximate="tanh"))


WHOLE = ("ln.weight", "ln.bias", "fc2.bias")


def _inputs(shape, salt, *tag) -> np.ndarray:
    return np.random.default_rng([salt, *tag]).standard_normal(shape)


def _block(t: int, comm) -> tuple[int, int]:
    per = t // comm.Get_size()
    return comm.Get_rank() * per, (comm.Get_rank() + 1) * per


def _plural(p: int) -> str:
    return f"{p} rank{'s' * (p > 1)}"


# -- part 1: the two operators ------------------------------------------------------------------


def _sent_problem(what, sent, expected, p, all_reduced_hint=True):
    if p == 1 or sent == expected:
        return None if sent == expected else (what, f"sent {sent} values on one rank", HINTS["bytes"])
    if sent == 0:
        return what, "sent nothing", HINTS["silent"]
    hint = HINTS["all_reduce"] if all_reduced_hint and sent > expected else HINTS["bytes"]
    return what, f"sent {sent} values, expected {expected} (one ring collective: (T-1) B t/T C)", hint


def _operators_rank(comm, Gather, Scatter, salt):
    p, rank = comm.Get_size(), comm.Get_rank()
    # long: both operators, forward then backward, each direction's values and bytes with its own hint
    start, stop = _block(SEQ, comm)
    per = SEQ // p
    block_values = BATCH * per * EMBD
    # g: all-gather forward, reduce-scatter backward
    what = f"GatherSequence.apply(x, comm=comm) on {_plural(p)} (x of shape {(BATCH, per, EMBD)}, float64)"
    whole = _inputs((BATCH, SEQ, EMBD), salt, 1)
    dys = [_inputs((BATCH, SEQ, EMBD), salt, 2, r) for r in range(p)]
    counted = CountingComm(comm, allow_collectives=True)
    x = Tensor(whole[:, start:stop].copy(), requires_grad=True)
    y = call_learner(what, Gather.apply, x, comm=counted, name="your GatherSequence.forward")
    forward = counted.elements
    problem = None
    if not isinstance(y, Tensor) or tuple(y.shape) != whole.shape:
        problem = what, f"expected a Tensor of shape {whole.shape}, got {getattr(y, 'shape', type(y).__name__)}", \
            HINTS["gather_shape"]
    elif not np.allclose(y.data, whole, rtol=0, atol=1e-12):
        problem = what, "the output is not every rank's block in rank order", HINTS["gather_values"]
    else:
        problem = _sent_problem(what + ", forward", forward, (p - 1) * block_values, p)
    fail_together(comm, problem)
    call_learner(what + ", backward", y.backward, dys[rank], name="your GatherSequence.backward")
    backward = counted.elements - forward
    want = np.sum(dys, axis=0)[:, start:stop]
    if x.grad is None or np.shape(x.grad) != want.shape:
        problem = what + ", backward", f"expected a gradient of shape {want.shape}, got " \
                                       f"{None if x.grad is None else np.shape(x.grad)}", HINTS["gather_backward"]
    elif not np.allclose(x.grad, want, rtol=0, atol=1e-12):
        own = np.allclose(x.grad, dys[rank][:, start:stop], rtol=0, atol=1e-12)
        problem = (what + ", backward", "x's gradient is not the ranks' gradients summed at this rank's positions",
                   HINTS["gather_backward_sum" if own and p > 1 else "gather_backward"])
    else:
        problem = _sent_problem(what + ", backward", backward, (p - 1) * block_values, p)
    fail_together(comm, problem)
    # ḡ: reduce-scatter forward, all-gather backward
    what = f"ReduceScatterSequence.apply(x, comm=comm) on {_plural(p)} (x of shape {(BATCH, SEQ, EMBD)}, float64)"
    xs = [_inputs((BATCH, SEQ, EMBD), salt, 3, r) for r in range(p)]
    whole_dy = _inputs((BATCH, SEQ, EMBD), salt, 4)
    counted = CountingComm(comm, allow_collectives=True)
    x = Tensor(xs[rank].copy(), requires_grad=True)
    y = call_learner(what, Scatter.apply, x, comm=counted, name="your ReduceScatterSequence.forward")
    forward = counted.elements
    want = np.sum(xs, axis=0)[:, start:stop]
    if not isinstance(y, Tensor) or tuple(y.shape) != want.shape:
        problem = what, f"expected a Tensor of shape {want.shape}, got {getattr(y, 'shape', type(y).__name__)}", \
            HINTS["scatter_shape"]
    elif not np.allclose(y.data, want, rtol=0, atol=1e-12):
        problem = what, "the output is not the ranks' sum at this rank's positions", HINTS["scatter_values"]
    else:
        problem = _sent_problem(what + ", forward", forward, (p - 1) * block_values, p)
    fail_together(comm, problem)
    call_learner(what + ", backward", y.backward, whole_dy[:, start:stop].copy(),
                 name="your ReduceScatterSequence.backward")
    backward = counted.elements - forward
    if x.grad is None or np.shape(x.grad) != whole_dy.shape:
        problem = what + ", backward", f"expected a gradient of shape {whole_dy.shape}, got " \
                                       f"{None if x.grad is None else np.shape(x.grad)}", HINTS["scatter_backward"]
    elif not np.allclose(x.grad, whole_dy, rtol=0, atol=1e-12):
        problem = (what + ", backward", "x's gradient is not every rank's block of the output's gradient",
                   HINTS["scatter_backward_own" if p > 1 else "scatter_backward"])
    else:
        problem = _sent_problem(what + ", backward", backward, (p - 1) * block_values, p, all_reduced_hint=False)
    fail_together(comm, problem)
    return f"p={p}: blocks of {per} positions, {(p - 1) * block_values} values sent each way by each operator"


def _operators_still_right(comm, Gather, Scatter, salt) -> bool:
    p, rank = comm.Get_size(), comm.Get_rank()
    start, stop = _block(SEQ, comm)
    whole = _inputs((BATCH, SEQ, EMBD), salt, 1)
    y = Gather.apply(Tensor(whole[:, start:stop].copy()), comm=CountingComm(comm, allow_collectives=True))
    others = np.delete(np.arange(SEQ), np.arange(start, stop))
    gathered = isinstance(y, Tensor) and any_right(np.asarray(y.data)[:, others], whole[:, others], 1e-12)
    xs = [_inputs((BATCH, SEQ, EMBD), salt, 3, r) for r in range(p)]
    z = Scatter.apply(Tensor(xs[rank].copy()), comm=CountingComm(comm, allow_collectives=True))
    return gathered or (isinstance(z, Tensor) and any_right(z.data, np.sum(xs, axis=0)[:, start:stop], 1e-12))


# -- part 2: the block, trained -----------------------------------------------------------------


def reference(p: int, salt: int, seed=0):
    """One process: the dense :class:`ResidualMLP` trained :data:`STEPS` SGD steps on the whole
    sequence; per step (the output, the input's gradient, the parameters after the step)."""
    dense, out = ResidualMLP(seed=seed), []
    for step in range(STEPS):
        x = Tensor(_inputs((BATCH, SEQ, EMBD), salt, 10, step), requires_grad=True)
        y = dense(x)
        y.backward(_inputs((BATCH, SEQ, EMBD), salt, 11, step))
        for param in dense.parameters():
            param.data -= LR * param.grad
            param.grad = None
        out.append((y.data, x.grad, {name: q.data.copy() for name, q in dense.named_parameters()}))
    return out


def _parts(dense_params: dict, start: int, stop: int) -> dict:
    """{name: this rank's part of the dense parameter} for hidden features start:stop."""
    return {"ln.weight": dense_params["ln.weight"], "ln.bias": dense_params["ln.bias"],
            "fc1.weight": dense_params["fc1.weight"][start:stop], "fc1.bias": dense_params["fc1.bias"][start:stop],
            "fc2.weight": dense_params["fc2.weight"][:, start:stop], "fc2.bias": dense_params["fc2.bias"]}


def _origins(block, parts: dict) -> dict:
    """{id(Parameter): dense name} for each of your block's Parameters, by its initial value."""
    found = {}
    for param in block.parameters():
        for name, part in parts.items():
            if name not in found.values() and np.shape(param.data) == part.shape and \
                    np.allclose(param.data, part, rtol=0, atol=1e-15):
                found[id(param)] = name
                break
    return found


def _held_bytes(block) -> int:
    """Bytes of the arrays your block holds: its Parameters and any array (or Tensor) among the
    attributes of it and its submodules, one level into lists, tuples and dicts."""
    arrays, seen = [], set()

    def add(value):
        data = value.data if isinstance(value, Tensor) else value
        if isinstance(data, np.ndarray) and id(data) not in seen:
            seen.add(id(data))
            arrays.append(data)

    modules = [block]
    while modules:
        module = modules.pop()
        for value in vars(module).values():
            if isinstance(value, nn.Module):
                modules.append(value)
            elif isinstance(value, dict) and value is not getattr(module, "_modules", None):
                for item in value.values():
                    modules.append(item) if isinstance(item, nn.Module) else add(item)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    add(item)
            else:
                add(value)
    return sum(a.nbytes for a in arrays)


def all_reduce_counts(comm, sizes=(EMBD, EMBD, EMBD)) -> set[int]:
    """The values this rank sends in the all-reduces of vectors of ``sizes`` numbers, fused into
    any grouping and by any one algorithm of ``all_reduce``. Collective."""
    def one(n):
        counts = {}
        for algorithm in ALL_REDUCE_ALGORITHMS:
            counted = CountingComm(comm, allow_collectives=True)
            all_reduce(counted, np.zeros(n), algorithm=algorithm)
            counts[algorithm] = counted.elements
        return counts

    total = sum(sizes)
    table = {n: one(n) for n in sorted({*sizes, total, *(a + b for a, b in itertools.combinations(sizes, 2))})}
    groupings = [list(sizes), [total]] + [[sizes[i] + sizes[j], sizes[k]] for i, j, k in ((0, 1, 2), (0, 2, 1),
                                                                                         (1, 2, 0))]
    return {sum(table[n][a] for n in grouping) for grouping in groupings for a in ALL_REDUCE_ALGORITHMS}


def _drift_problem(what, comm, block, origins, want: dict, p: int):
    """The problem with your parameters after a step (against ``want``, this rank's parts of the
    dense ones), or None. Collective: the whole ones are compared across the ranks."""
    mine = {origins[id(q)]: np.asarray(q.data, dtype=np.float64) for q in block.parameters() if id(q) in origins}
    problem = None
    for name in WHOLE:  # gathered on every rank, in the same order, whatever this rank found
        everyone = all_gather(comm, mine[name])
        if problem is None and not np.allclose(mine[name], want[name], rtol=0, atol=ATOL):
            same = all(np.allclose(other, everyone[0], rtol=0, atol=1e-13) for other in everyone)
            key = "mean" if same and p > 1 else "drift" if not same else "block_values"
            detail = "differs on the ranks" if not same else "differs from one process's"
            problem = (what, f"{name} {detail} (by up to {float(np.max(np.abs(mine[name] - want[name]))):.3g})",
                       HINTS[key].format(name=name))
    if problem is None:
        for name in ("fc1.weight", "fc1.bias", "fc2.weight"):
            if not np.allclose(mine[name], want[name], rtol=0, atol=ATOL):
                worst = float(np.max(np.abs(mine[name] - want[name])))
                problem = (what, f"{name} differs from its part of one process's by up to {worst:.3g}",
                           HINTS["sharded"].format(name=name))
                break
    return problem


def _mlp_rank(comm, SequenceParallelMLP, salt):
    p, rank = comm.Get_size(), comm.Get_rank()
    # long: three SGD steps, each checked in the order a mistake shows: output, input gradient, drift, bytes
    start_t, stop_t = _block(SEQ, comm)
    start, stop = chunk_bounds(HIDDEN, p)[rank]
    per = BATCH * (SEQ // p) * EMBD
    expected = reference(p, salt)
    extra = all_reduce_counts(comm)
    what = f"SequenceParallelMLP(dense, comm) on {_plural(p)} (C = {EMBD}, hidden {HIDDEN}: features {start}:{stop})"
    dense = ResidualMLP()
    parts = _parts({n: q.data for n, q in dense.named_parameters()}, start, stop)
    counted = CountingComm(comm, allow_collectives=True)
    block = call_learner(what, SequenceParallelMLP, dense, counted, name="your SequenceParallelMLP.__init__")
    origins = _origins(block, parts) if isinstance(block, nn.Module) else {}
    shard_bytes = sum(part.nbytes for part in parts.values())
    problem = None
    if sorted(origins.values()) != sorted(parts):
        missing = sorted(set(parts) - set(origins.values()))
        uneven = HIDDEN % p and any(np.shape(q.data) in ((HIDDEN // p, EMBD), (EMBD, HIDDEN // p))
                                    for q in getattr(block, "parameters", list)())
        problem = (what, f"no Parameter of the block holds this rank's part of {', '.join(missing)}",
                   HINTS["uneven" if uneven else "held"])
    elif _held_bytes(block) > shard_bytes:
        problem = what, f"the block holds {_held_bytes(block):,} bytes of arrays, more than its shard's " \
                        f"{shard_bytes:,}", HINTS["held"]
    fail_together(comm, problem)
    for step in range(STEPS):
        here = f"{what}, step {step + 1} of {STEPS}"
        want_y, want_dx, want_params = expected[step]
        x = Tensor(_inputs((BATCH, SEQ, EMBD), salt, 10, step)[:, start_t:stop_t].copy(), requires_grad=True)
        before = counted.elements
        y = call_learner(here, block, x, name="your SequenceParallelMLP.forward")
        want = want_y[:, start_t:stop_t]
        if not isinstance(y, Tensor) or tuple(y.shape) != want.shape:
            problem = here, f"expected an output Tensor of shape {want.shape}, got " \
                            f"{getattr(y, 'shape', type(y).__name__)}", HINTS["block_values"]
        elif not np.allclose(y.data, want, rtol=0, atol=ATOL):
            bias = (p - 1) * parts["fc2.bias"] if step == 0 else np.nan
            key = "bias_every_rank" if p > 1 and np.allclose(y.data, want + bias, atol=ATOL) else "block_values"
            problem = here, f"the output differs from one process's at this rank's positions by up to " \
                            f"{float(np.max(np.abs(y.data - want))):.3g}", HINTS[key]
        fail_together(comm, problem)
        dy = _inputs((BATCH, SEQ, EMBD), salt, 11, step)[:, start_t:stop_t].copy()
        call_learner(here + ", backward", y.backward, dy, name="your SequenceParallelMLP's backward")
        sent = counted.elements - before
        if x.grad is None or not np.allclose(x.grad, want_dx[:, start_t:stop_t], rtol=0, atol=ATOL):
            problem = here, "the input's gradient differs from one process's at this rank's positions", \
                HINTS["input_grad"]
        fail_together(comm, problem)
        for param in block.parameters():  # the check's own SGD step
            if param.grad is not None:
                param.data = param.data - LR * param.grad
            param.grad = None
        fail_together(comm, _drift_problem(here + ", after the SGD step", comm, block, origins,
                                           _parts(want_params, start, stop), p))
        formula = 4 * (p - 1) * per
        if p > 1 and sent - formula not in extra:
            what_sent = f"sent {sent} values; the formula: 4 (T-1) B t/T C = {formula}, plus the whole " \
                        f"parameters' all-reduce ({' or '.join(map(str, sorted(extra)))})"
            problem = here, what_sent, HINTS["gather_twice" if sent > formula + max(extra) else "block_bytes"].format(
                extra="3 C numbers")
        elif p == 1 and sent:
            problem = here, f"sent {sent} values on one rank", HINTS["block_bytes"].format(extra="nothing on one rank")
        fail_together(comm, problem)
    return f"p={p}: {STEPS} SGD steps equal one process, whole parameters equal on every rank, " \
           f"{sent} values sent per step ({4 * (p - 1) * per} for g and ḡ + {sent - 4 * (p - 1) * per} " \
           f"for the whole parameters' gradients)"


def _mlp_still_right(comm, SequenceParallelMLP, salt) -> bool:
    start_t, stop_t = _block(SEQ, comm)
    block = SequenceParallelMLP(ResidualMLP(), CountingComm(comm, allow_collectives=True))
    y = block(Tensor(_inputs((BATCH, SEQ, EMBD), salt, 10, 0)[:, start_t:stop_t].copy(), requires_grad=True))
    return isinstance(y, Tensor) and any_right(y.data, reference(comm.Get_size(), salt)[0][0][:, start_t:stop_t],
                                               1e-9)


def _sums_still_right(comm, SequenceParallelMLP, salt) -> bool:
    """One training step of the block again, every message of at most 3 C numbers spoiled in
    transit (the whole parameters' gradient sums; g's and ḡ's blocks are larger and arrive as
    sent): is any value of a whole parameter after the step still one process's? Then its
    gradient's parts did not meet through the communicator."""
    p, rank = comm.Get_size(), comm.Get_rank()
    start_t, stop_t = _block(SEQ, comm)
    start, stop = chunk_bounds(HIDDEN, p)[rank]
    dense = ResidualMLP()
    parts = _parts({n: q.data for n, q in dense.named_parameters()}, start, stop)
    block = SequenceParallelMLP(dense, CountingComm(comm, allow_collectives=True))
    origins = _origins(block, parts)
    y = block(Tensor(_inputs((BATCH, SEQ, EMBD), salt, 10, 0)[:, start_t:stop_t].copy(), requires_grad=True))
    y.backward(_inputs((BATCH, SEQ, EMBD), salt, 11, 0)[:, start_t:stop_t].copy())
    want = reference(p, salt)[0][2]
    for param in block.parameters():
        if origins.get(id(param)) in WHOLE and param.grad is not None:
            if any_right(param.data - LR * param.grad, want[origins[id(param)]], 1e-9):
                return True
    return False


def _small(array, tag) -> bool:
    return array.size <= 3 * EMBD


def _on_sim(rank_fn, still_right, args, name, sums=None):
    lines = [f"{name}: ok"]
    salt = secrets.randbits(64)
    for p in WORLD_SIZES:
        try:
            verdicts = sim.World(p, timeout=60).run(rank_fn, *args, salt)
        except (sim.DeadlockError, sim.SimTimeoutError) as error:
            fail(f"{name} on {p} simulated ranks", str(error), DEADLOCK_HINT)
        check_received(f"{name} on {p} simulated ranks", p, still_right, *args, salt)
        if sums is not None:
            check_received(f"{name} on {p} simulated ranks, the whole parameters' gradients", p, sums, *args, salt,
                           which=_small, hint=HINTS["sums_received"])
        lines.append(verdicts[0])
    return "\n".join(lines)


_ENGINE = (operators.GatherFromSequenceParallelRegion.forward, operators.GatherFromSequenceParallelRegion.backward,
           operators.ReduceScatterToSequenceParallelRegion.forward,
           operators.ReduceScatterToSequenceParallelRegion.backward, operators.all_gather_sequence,
           operators.reduce_scatter_sequence, operators.CopyToTensorParallelRegion.backward,
           operators.ReduceFromTensorParallelRegion.forward, tp_gpt.SequenceParallelLayerNorm.forward,
           layers.ColumnParallelLinear.forward, layers.RowParallelLinear.forward,
           layers.AllGatherLinear.forward, layers.LinearReduce.forward)


@forbidding(*_ENGINE)
@unchanged(sys.modules[__name__], collectives, sim, np)
def check_sequence_operators(GatherSequence, ReduceScatterSequence) -> str:
    """Check your two sequence-parallel operators (module docstring, part 1)."""
    check_own_code(GatherSequence, "GatherSequence", methods=("forward", "backward"))
    check_own_code(ReduceScatterSequence, "ReduceScatterSequence", methods=("forward", "backward"))
    return _on_sim(_operators_rank, _operators_still_right, (GatherSequence, ReduceScatterSequence),
                   "GatherSequence and ReduceScatterSequence")


@forbidding(*_ENGINE)
@unchanged(sys.modules[__name__], collectives, sim, np)
def check_sequence_parallel_mlp(SequenceParallelMLP) -> str:
    """Check your ``SequenceParallelMLP(dense, comm)`` (module docstring, part 2): three SGD steps."""
    check_own_code(SequenceParallelMLP, "SequenceParallelMLP", methods=("__init__", "forward"))
    return _on_sim(_mlp_rank, _mlp_still_right, (SequenceParallelMLP,), "SequenceParallelMLP", _sums_still_right)


__all__ = ["BATCH", "EMBD", "HIDDEN", "HINTS", "LR", "SEQ", "STEPS", "WHOLE", "ResidualMLP", "all_reduce_counts",
           "check_sequence_operators", "check_sequence_parallel_mlp", "reference"]

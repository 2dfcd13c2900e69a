"""What a step of the 3-D driver sends and holds, predicted from the layout alone.

The planner (:mod:`minidist.planner`) predicts a cluster's memory and step time from formulas;
this module is the same counting done exactly for this course's own engine, so that a
prediction can be checked against a measurement on the simulator, byte for byte
(``tests/test_three_d.py``, chapter 16).

Notation: P = D x S x T ranks (dp, pp, tp), V stages per rank (interleaved) so N = S V stages,
m micro-batches of b_1..b_m windows (``numpy.array_split`` of the batch B), windows of T_w
positions (``block_size``), C channels, L blocks, vocabulary V_o, s bytes per value. A
collective of n bytes over g ranks makes all of them send, together,

    all_reduce     g x costmodel.terms("all_reduce", a, n, g)[1]  with a the algorithm "auto"
                   picks (``costmodel.choose_all_reduce``): 2(g-1) n for the ring, g lg g n
                   for recursive doubling: exact, however unevenly n splits into chunks
    all_gather,
    reduce_scatter (g - 1) n  (every rank forwards every chunk but one)

and a collective over a group of one sends nothing. Per micro-batch of b windows, a = b T_w C s:

- **tp** (each tp group of a stage with k blocks): without sequence parallelism 4k all-reduces
  of a (two forward, two backward per block), one more on the first stage (the embedding's
  sum over the vocabulary) and on the last (the head's backward), and the loss's three
  all-reduces of one number per position (b T_w s; the sum one carries the rank's vocabulary
  width too: (b T_w + 1) s). With sequence parallelism each of those all-reduces of a becomes a
  reduce-scatter and an all-gather, and the column-parallel layers gather their input again in
  backward: 10 halves per block, 2 on the first stage, 3 on the last; the whole parameters
  used on a block of positions all-reduce their gradient at every use: 6 vectors of C per block,
  ln_f's 2 on the last stage, the position table (T_w C) on the first. Once a step: the
  clipping's sum of squares (one float64).
- **pp** (each of the D T pipelines): every one of the N - 1 boundaries carries each
  micro-batch's activation forward and its gradient back (a, or a / T with sequence
  parallelism: the rank's block of positions); the first step also sends one header per
  boundary (shape and dtype: ``executor.HEADER_BYTES``, 80 bytes). Once a step with S > 1: the loss broadcast
  (S - 1 messages of one float64), the clipping's all-reduce of two float64, and, on the
  first and last stage's ranks, the tied embedding's gradient shard each way (2 V_r C s).
- **dp** (each dp group): one all-reduce of the rank's gradients and the loss ((n_params + 1) s);
  with ``--zero`` (ZeRO-1 over dp) a reduce-scatter of the gradients and an all-gather of the
  updated parameters, each of the vector padded to a multiple of D, the loss (one float64) and
  the clipping's two float64 numbers.

Parameters per rank: a block holds 6C + (12C^2 + 7C) / T (LayerNorms and the row-parallel
biases whole, the rest cut by T); the first stage adds its vocabulary rows V_r C and the position
table T_w C; the last ln_f (2C) and, when it is another rank, its copy of the vocabulary rows.
"""
from __future__ import annotations

from minidist import costmodel
from minidist.collectives import chunk_bounds
from minidist.models.gpt_pipeline import block_balance
from minidist.parallel.pipeline.executor import HEADER_BYTES


def all_reduce_total(nbytes: int, group: int) -> float:
    """Bytes all ``group`` ranks send together in one all-reduce of ``nbytes`` ("auto")."""
    if group == 1:
        return 0.0
    return group * costmodel.terms("all_reduce", costmodel.choose_all_reduce(nbytes, group), nbytes, group)[1]


def half_total(nbytes: int, group: int) -> int:
    """Bytes all ``group`` ranks send together in one all-gather or reduce-scatter of a vector
    of ``nbytes`` (the whole): (group - 1) x nbytes."""
    return (group - 1) * nbytes


def stage_blocks(n_layer: int, num_stages: int) -> list[tuple[int, bool, bool]]:
    """(blocks, is_first, is_last) of each of the pipeline's stages (``block_balance``'s cut:
    the embeddings on the first stage and the head on the last, counted apart)."""
    counts = block_balance(n_layer, num_stages)
    counts[0] -= 1
    counts[-1] -= 1
    return [(k, s == 0, s == num_stages - 1) for s, k in enumerate(counts)]


def vocabulary_rows(vocab_size: int, tp: int) -> list[int]:
    """Each tp rank's rows of the vocabulary (``numpy.array_split``'s cut)."""
    return [stop - start for start, stop in chunk_bounds(vocab_size, tp)]


def parameter_counts(config, dp: int, pp: int, tp: int, vocab_size: int, stages_per_rank: int = 1) -> list[int]:
    """Each rank's parameter count (rank order of the (dp, pp, tp) mesh): its stages' shards,
    a parameter held twice on one rank (the tied embedding when one rank holds the first and the
    last stage) once. ``config``: a TrainConfig (n_layer, n_embd, block_size)."""
    c, num_stages = config.n_embd, pp * stages_per_rank
    rows = vocabulary_rows(vocab_size, tp)
    counts = []
    for _ in range(dp):
        for p in range(pp):
            for t in range(tp):
                total, tied = 0, False
                for s, (k, first, last) in enumerate(stage_blocks(config.n_layer, num_stages)):
                    if s % pp != p:
                        continue
                    total += k * (6 * c + (12 * c * c + 7 * c) // tp)
                    if first:
                        total += rows[t] * c + config.block_size * c
                    if last:
                        total += 2 * c + (0 if first or tied else rows[t] * c)
                    tied = tied or first
                counts.append(total)
    return counts


def padded(n: int, ranks: int) -> int:
    """``n`` rounded up to a multiple of ``ranks`` (ZeRO's flat vector: equal shards)."""
    return -(-n // ranks) * ranks


def step_bytes(config, dp: int, pp: int, tp: int, vocab_size: int, itemsize: int, first_step: bool = False) -> dict:
    """What all P ranks send together in one training step, by group: {"tp", "pp", "dp"} ->
    bytes (floats, exact to rounding; module docstring). ``config``: the run's TrainConfig
    (n_layer, n_embd, block_size, batch_size, microbatches, schedule, stages_per_rank,
    sequence_parallel); ``itemsize``: bytes per value of the model (4 float32, 8 float64);
    ``first_step``: add the pipeline's one-off headers."""
    c, window, sp = config.n_embd, config.block_size, config.sequence_parallel and tp > 1
    v = config.stages_per_rank if config.schedule == "interleaved" else 1
    num_stages = pp * v
    sizes = [stop - start for start, stop in chunk_bounds(config.batch_size, config.microbatches)]
    tp_bytes = pp_bytes = dp_bytes = 0.0
    for blocks, first, last in stage_blocks(config.n_layer, num_stages):
        per_group = all_reduce_total(8, tp)  # the clipping's float64
        for b in sizes:
            a, positions = b * window * c * itemsize, b * window * itemsize
            if sp:
                per_group += (10 * blocks + 2 * first + 3 * last) * half_total(a, tp)
                per_group += 6 * blocks * all_reduce_total(c * itemsize, tp)
                per_group += first * all_reduce_total(window * c * itemsize, tp)
                per_group += last * 2 * all_reduce_total(c * itemsize, tp)
            else:
                per_group += (4 * blocks + first + last) * all_reduce_total(a, tp)
            if last:
                per_group += 2 * all_reduce_total(positions, tp) + all_reduce_total(positions + itemsize, tp)
        tp_bytes += dp * per_group  # one tp group per (dp, stage)
    if pp > 1:
        activations = sum(b * window * c * itemsize // (tp if sp else 1) for b in sizes)
        per_pipeline = 2 * (num_stages - 1) * activations + (pp - 1) * 8 + all_reduce_total(16, pp)
        per_pipeline += (num_stages - 1) * HEADER_BYTES if first_step else 0
        pp_bytes = dp * tp * per_pipeline + dp * 2 * vocab_size * c * itemsize  # tied: each tp shard both ways
    if dp > 1:
        counts = parameter_counts(config, 1, pp, tp, vocab_size, v)  # one dp group per (pp, tp)
        if config.zero:  # reduce-scatter and all-gather of the padded vector, the loss, the clipping's two numbers
            dp_bytes = sum(2 * half_total(padded(n, dp) * itemsize, dp) for n in counts)
            dp_bytes += pp * tp * (all_reduce_total(8, dp) + (all_reduce_total(16, dp) if config.grad_clip else 0))
        else:
            dp_bytes = sum(all_reduce_total((n + 1) * itemsize, dp) for n in counts)
    return {"tp": tp_bytes, "pp": pp_bytes, "dp": dp_bytes}

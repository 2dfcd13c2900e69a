"""Context parallelism (issue 31, parts 2 and 4): every variant of ``context_parallel_attention``
gives dense attention's output and dQ, dK, dV (float64, 1e-12) on the simulator for P = 1..4,
causal and not, on lengths no P divides; the layouts hold the positions the papers give them;
each rank computes the chunk pairs of the causal triangle the layout predicts (contiguous rank r:
r + 1; zig-zag: 2P + 1 half-size pairs every rank) and sends the bytes of the closed forms; a ring
of blocking Sends is a deadlock the sim names; bad input raises on every rank, naming the fix;
the GPT under cp (2 and 4 ranks, and dp 2 x cp 2) trains as one process does; and the same
under mpiexec (tests/mpi/context_parallel.py)."""
import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest
import test_gpt_train
from mpitools import JOB_ENV, mpiexec_or_skip
from test_gpt_train import TINY, differences_from

from minidist import functions as F
from minidist import launch, sim, train
from minidist.cli import train_flags
from minidist.collectives import TAGS
from minidist.parallel.context_parallel import (
    BlockCounter,
    context_parallel_attention,
    gather_sequence,
    rank_positions,
    shard_sequence,
)
from minidist.parallel.context_parallel.ring import DKV_TAG, KV_BACKWARD_TAG, KV_TAG, finish_pass, pass_block
from minidist.parallel.context_parallel.train import check_context_parallel, train_context_parallel
from minidist.tensor import Tensor

text, float64 = test_gpt_train.text, test_gpt_train.float64  # the GPT tests' fixtures
VARIANTS = ("ring", "zigzag", "allgather", "ulysses")
B, H, D = 2, 12, 3  # 12 heads: Ulysses on 1, 2, 3 and 4 ranks


def dense(q, k, v, do, is_causal):
    """The oracle: minidist's one-process fused attention (itself checked against torch and
    finite differences in test_transformer_ops), its output and dQ, dK, dV for the cotangent do."""
    qt, kt, vt = (Tensor(a.copy(), requires_grad=True) for a in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=is_causal)
    out.backward(do)
    return [out.data, qt.grad, kt.grad, vt.grad]


def cp_rank(comm, q, k, v, do, is_causal, variant):
    """One rank: its parts, the cp attention and its backward, the results gathered whole."""
    parts = [Tensor(shard_sequence(a, comm, variant), requires_grad=True) for a in (q, k, v)]
    counter = BlockCounter()
    out = context_parallel_attention(*parts, comm, is_causal=is_causal, variant=variant, counter=counter)
    out.backward(shard_sequence(do, comm, variant))
    return [gather_sequence(a, comm, variant) for a in (out.data, *(p.grad for p in parts))], counter


def arrays(t, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, H, t, D)) for _ in range(4)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_is_dense_attention_forward_and_backward(variant):
    """P = 1..4, causal and not, T = 8 (a multiple of every P) and 13 (of none but 1): output
    and the three gradients within 1e-12 of dense attention on every rank."""
    for t in (8, 13):
        q, k, v, do = arrays(t, seed=t)
        for is_causal in (True, False):
            expected = dense(q, k, v, do, is_causal)
            for p in (1, 2, 3, 4):
                for rank, (got, _) in enumerate(sim.run(cp_rank, p, q, k, v, do, is_causal, variant)):
                    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
                        assert np.abs(a - b).max() < 1e-12, (variant, t, is_causal, p, rank, name)


def test_the_layouts_hold_the_papers_positions_and_shard_sequence_is_differentiable():
    """Contiguous: array_split's blocks; zig-zag: chunks r and 2P-1-r (torch's head-tail: T = 8,
    P = 2 gives [0 1 6 7] and [2 3 4 5]); a Tensor's part passes its gradient back to x."""
    assert [rank_positions(8, 2, r, "zigzag").tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [rank_positions(16, 4, r, "zigzag").tolist()[::2] for r in range(4)] == [[0, 14], [2, 12], [4, 10], [6, 8]]
    assert [len(rank_positions(13, 4, r, "ring")) for r in range(4)] == [4, 3, 3, 3]
    assert rank_positions(13, 4, 1, "ulysses").tolist() == [4, 5, 6]

    def rank(comm):
        x = Tensor(np.arange(2 * 3 * 8, dtype=np.float64).reshape(2, 3, 8), requires_grad=True)
        part = shard_sequence(x, comm, "zigzag", axis=2)
        (part * part).sum().backward()
        return part.data, x.grad, gather_sequence(part.data, comm, "zigzag", axis=2)

    for r, (part, grad, whole) in enumerate(sim.run(rank, 2)):
        mine = rank_positions(8, 2, r, "zigzag")
        x = np.arange(48.0).reshape(2, 3, 8)
        assert np.array_equal(part, x[..., mine]) and np.array_equal(whole, x)
        expected = np.zeros_like(x)
        expected[..., mine] = 2 * x[..., mine]
        assert np.array_equal(grad, expected)


def test_each_rank_computes_the_block_pairs_of_its_layout():
    """Causal, T = 8 x P: contiguous rank r computes r + 1 blocks of (T/P)² scores, zig-zag every
    rank 2P + 1 half-size chunks of (T/2P)² (the triangle balanced), forward and backward alike."""
    for p in (1, 2, 3, 4):
        t = 8 * p
        q, k, v, do = arrays(t)
        ring = [counter for _, counter in sim.run(cp_rank, p, q, k, v, do, True, "ring")]
        zigzag = [counter for _, counter in sim.run(cp_rank, p, q, k, v, do, True, "zigzag")]
        assert [c.forward_pairs for c in ring] == [c.backward_pairs for c in ring] == [r + 1 for r in range(p)]
        assert [c.forward_scores for c in ring] == [(r + 1) * 8 * 8 for r in range(p)]
        assert [c.forward_pairs for c in zigzag] == [c.backward_pairs for c in zigzag] == [2 * p + 1] * p
        assert [c.forward_scores for c in zigzag] == [(2 * p + 1) * 4 * 4] * p


def sent(world, rank, tags):
    """The array bytes ``rank`` sent with one of ``tags`` in the world's last run."""
    return sum(m.nbytes for m in world.trace if m.source == rank and m.tag in tags and m.kind == "array")


@pytest.mark.parametrize("p", [2, 3, 4])
def test_each_rank_sends_the_closed_form_bytes(p):
    """Per rank and call, b = B·(T/P)·h values of one rank's K (h = H·d), 8 bytes each:
    ring and zig-zag forward 2(P-1)b (the issue's 2(P-1)(T/P)h per sequence), backward
    2(P-1)b of K, V and 2Pb of dK, dV; all-gathered K/V 2(P-1)b each way; Ulysses
    4(P-1)BTh/P² each way (3 of q, k, v and 1 of the output, each keeping 1/P at home)."""
    t = 4 * p
    q, k, v, do = arrays(t)
    b = B * (t // p) * H * D * 8
    for variant in VARIANTS:
        world = sim.World(p)
        world.run(cp_rank, q, k, v, do, True, variant)
        for r in range(p):
            if variant in ("ring", "zigzag"):
                assert (sent(world, r, {KV_TAG}), sent(world, r, {KV_BACKWARD_TAG}), sent(world, r, {DKV_TAG})) == \
                       (2 * (p - 1) * b, 2 * (p - 1) * b, 2 * p * b), (variant, r)
            elif variant == "allgather":
                gathered, scattered = sent(world, r, {TAGS["all_gather"]}), sent(world, r, {TAGS["reduce_scatter"]})
                assert (gathered - (p - 1) * (gathered // (p - 1) - 2 * b), scattered) == (2 * (p - 1) * b,) * 2
            else:
                assert sent(world, r, {TAGS["all_to_all"]}) == 2 * 4 * (p - 1) * B * t * H * D * 8 // p ** 2


def test_a_ring_of_blocking_sends_deadlocks_where_the_posted_exchange_does_not():
    """A K/V block of 8 KiB (past the sim's eager limit, as past MPICH's): every rank Sends it to
    the right and then Recvs from the left, and the sim names the cycle; the ring's own step
    (pass_block: Irecv and Isend posted together) moves the same block around."""
    block = np.arange(1024, dtype=np.float64)

    def blocking(comm):
        rank, p = comm.Get_rank(), comm.Get_size()
        got = np.empty_like(block)
        comm.Send(block + rank, dest=(rank + 1) % p, tag=KV_TAG)
        comm.Recv(got, source=(rank - 1) % p, tag=KV_TAG)
        return got

    with pytest.raises(sim.DeadlockError, match=r"wait-for cycle: rank 0 -> rank 1 -> rank 2 -> rank 3 -> rank 0"):
        sim.run(blocking, 4)

    def posted(comm):
        rank = comm.Get_rank()
        return finish_pass(comm, pass_block(comm, block + rank, block.shape, KV_TAG), "test")

    assert [got[0] for got in sim.run(posted, 4)] == [3.0, 0.0, 1.0, 2.0]


def test_the_next_block_is_posted_before_this_block_is_computed(monkeypatch):
    """Overlap, P = 3: in each step but the last the ring posts the next K/V block's exchange
    before it computes on the block it holds (the message travels meanwhile), forward and
    backward; backward posts each dK/dV accumulator after its compute, waited for a step later."""
    from minidist.parallel.context_parallel import ring
    order = []

    def noted(fn, what):
        def call(*args):
            order.append((what, threading.get_ident()))
            return fn(*args)
        return call

    for name, what in {"pass_block": "post", "attend": "compute", "attend_backward": "backward"}.items():
        monkeypatch.setattr(ring, name, noted(getattr(ring, name), what))
    q, k, v, do = arrays(12)
    sim.run(cp_rank, 3, q, k, v, do, True, "ring")
    threads = {who for _, who in order}
    assert len(threads) == 3
    for thread in threads:
        assert [what for what, who in order if who == thread] == [
            "post", "compute", "post", "compute", "compute",  # forward: K/V posted, then the held block computed
            "post", "backward", "post", "post", "backward", "post", "backward", "post"]  # K/V, compute, dK/dV


def bad_call(comm, variant="ring", length=None, is_causal=True):
    """context_parallel_attention on parts of (1, 3, length(rank), 2) (default 5 positions);
    ``is_causal`` None: True on rank 0 only."""
    mine = np.zeros((1, 3, 5 if length is None else length(comm.Get_rank()), 2))
    causal = comm.Get_rank() == 0 if is_causal is None else is_causal
    return context_parallel_attention(mine, mine, mine, comm, is_causal=causal, variant=variant)


@pytest.mark.parametrize("p,options,message", [
    (2, dict(variant="ulysses"), r"H = 3 heads do not divide by 2; use a number of cp ranks among \[1, 3\]"),
    (2, dict(variant="tree"), r"no variant 'tree'; choose one of ring, zigzag, allgather, ulysses"),
    (2, dict(length=lambda r: 2 + r), r"lengths \[2, 3\] are not the ring cut of 5 .* shard_sequence"),
    (3, dict(variant="zigzag", length=lambda r: 1), r"6 chunks .* only 3 positions; use a sequence of at least 6"),
    (2, dict(is_causal=None), r"the ranks disagree")])
def test_bad_input_raises_on_every_rank_naming_the_fix(p, options, message):
    world = sim.World(p)
    with pytest.raises(ValueError, match=message):
        world.run(bad_call, **options)
    assert len(world.errors) == p  # every rank raised; none was left waiting


def test_shard_sequence_refuses_an_axis_the_array_lacks():
    with pytest.raises(ValueError, match="shard_sequence: axis 4 is not an axis"):
        sim.run(lambda comm: shard_sequence(np.zeros((1, 3, 5, 2)), comm, "ring", axis=4), 1)


# ------------------------------------------------------------------------------ the GPT under cp

CP = dict(TINY, n_layer=2, n_head=4, steps=3, eval_every=3, scale_lr=False, strategy="cp")


def single_on_global_batch(config, text, cache={}):  # noqa: B006 (one run per global batch, kept)
    if config.dp not in cache:
        cache[config.dp] = train.train_single(dataclasses.replace(config, strategy="single", dp=1,
                                                                  batch_size=config.batch_size * config.dp), text)
    return cache[config.dp]


@pytest.mark.parametrize("ranks,dp,variant,pairs", [(2, 1, "ring", "2,4"), (4, 1, "zigzag", "18,18,18,18"),
                                                    (4, 1, "ulysses", "2,2,2,2"), (4, 2, "allgather", "2,2,2,2")])
def test_the_gpt_under_cp_trains_as_one_process(text, float64, ranks, dp, variant, pairs):
    """Three AdamW steps (warm-up, cosine, clipping) in float64: the weights and evaluations of
    one process on the global batch (dp x 8 windows) to 1e-10, and the attention pairs each rank
    computed per step (2 layers: contiguous rank r (r + 1) each, zig-zag 2P + 1 each)."""
    config = train.TrainConfig(**CP, cp_variant=variant, dp=dp)
    single = single_on_global_batch(config, text)
    result = sim.run(lambda comm: train_context_parallel(comm, config, text), ranks)[0]
    assert differences_from(single, result) == []
    figures = result.figures
    assert (figures["dp"], figures["cp"], figures["global_batch"]) == (dp, ranks // dp, 8 * dp)
    assert figures["block_pairs_per_step"] == pairs


@pytest.mark.parametrize("world,change,message", [
    (4, dict(dp=3), r"--dp 3 does not divide the 4 ranks"),
    (4, dict(cp_variant="zigzag", block_size=6), r"into 8 parts over 4 cp ranks; use --block-size 8 or more"),
    (3, dict(cp_variant="ulysses"), r"H = 4 heads do not divide by 3"),
    (2, dict(dropout=0.1), r"--strategy cp needs --dropout 0"),
    (2, dict(model="mlp"), r"use --model gpt")])
def test_layouts_cp_cannot_run_are_refused_naming_the_fix(world, change, message):
    with pytest.raises(ValueError, match=message):
        check_context_parallel(world, train.TrainConfig(**dict(CP, **change)))


def test_the_command_line_takes_cp_and_refuses_its_flags_elsewhere():
    parser = train_flags.train_parser()
    config = train_flags.train_config(parser.parse_args(["--model", "gpt", "--strategy", "cp", "--cp-variant",
                                                         "zigzag", "--dp", "2", "--global-batch-size", "8"]))
    assert (config.strategy, config.cp_variant, config.dp, config.global_batch_size) == ("cp", "zigzag", 2, 8)
    with pytest.raises(ValueError, match=r"--cp-variant applies to --strategy cp only"):
        train_flags.train_config(parser.parse_args(["--model", "gpt", "--strategy", "tp", "--cp-variant", "ring"]))
    with pytest.raises(ValueError, match=r"--tp applies to --strategy fsdp, 3d and cp only, not to --strategy tp"):
        train_flags.train_config(parser.parse_args(["--model", "gpt", "--strategy", "tp", "--tp", "2"]))


@pytest.mark.mpi
def test_the_variants_and_a_cp_run_equal_one_process_under_mpiexec():
    """tests/mpi/context_parallel.py on 2 and 4 real ranks (float64): every variant's output and
    gradients against dense attention, and short cp runs (with dp on 4 ranks) against one process."""
    mpiexec_or_skip()
    script = Path(__file__).parent / "mpi" / "context_parallel.py"
    for ranks in (2, 4):
        result = launch.launch(script, ranks, timeout=300, env=JOB_ENV)
        assert result.ok and "CP OK" in result.stdout, result.stdout + result.stderr[-3000:]

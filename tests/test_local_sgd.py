"""DiLoCo, Streaming DiLoCo and replicas that come and go (``minidist.parallel.local_sgd``), on the sim.

The oracles: DDP (another algorithm that must give the same step when H = 1), the same DiLoCo
written sequentially in one process below (:func:`reference`: M replicas in a loop, the
pseudo-gradients summed in rank order, the outer Nesterov step from its formula), the sim's trace
(which messages went when, and their bytes) and bit-for-bit equality of the replicas' states.
Everything in float64 on a small MLP, so agreement is to rounding (1e-12).

Longer than 400 lines: one wing's tests share one replica function and one sequential oracle
(the algorithm, the churn, the 4-bit hook, the driver and the mpiexec launch all use them).
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest
from mpitools import JOB_ENV, requires_mpi

from minidist import launch, nn, optim, sim
from minidist.functions import cross_entropy
from minidist.parallel.data_parallel.ddp import DistributedDataParallel
from minidist.parallel.local_sgd import (
    DiLoCo,
    ReplicaGroup,
    ReplicaRefused,
    ReplicaSet,
    due_fragments,
    flatten,
    fragment_offsets,
    split_parameters,
)
from minidist.tensor import Tensor

SIZES = [6, 8, 8, 3]  # 3 Linear layers: 6 parameter tensors
ALL_REDUCE_TAGS = range(9000, 10000)  # async_collectives' tags: DDP's buckets and DiLoCo's pseudo-gradients


def data(replica: int, step: int):
    """Replica ``replica``'s batch at inner step ``step`` (from 1): 8 rows, 3 classes."""
    rng = np.random.default_rng(1000 * replica + step)
    return rng.standard_normal((8, SIZES[0])), rng.integers(0, SIZES[-1], 8)


def model_and_optimizer(inner: str, sizes=SIZES):
    model = nn.mlp(sizes, rng=0, dtype="float64")
    if inner == "adamw":
        return model, optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim.SGD(model.parameters(), lr=0.1)


def inner_step(model, optimizer, replica, step):
    x, y = data(replica, step)
    optimizer.zero_grad()
    cross_entropy(model(Tensor(x)), y).backward()
    optimizer.step()


def state_hash(diloco) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in diloco.state_arrays())).hexdigest()


def replica(comm, H, steps, *, inner="sgd", fragments=1, outer=(0.7, 0.9, True), members=None, kill=None,
            rejoin=False, spare=None, sizes=SIZES, comm_hook="none"):
    """One replica's run on the sim: ``steps`` inner steps with DiLoCo around them. ``kill``:
    (rank, step): that rank stops before that inner step (returns None, or with ``rejoin``
    starts over as a joiner: a fresh model, its state from a peer). ``spare``: a rank that is
    not a member at first and joins. Returns the shared state, the local weights, the members it
    sees and {syncs: hash of the shared state} after each of its syncs."""
    rank = comm.Get_rank()

    def build(join):
        model, optimizer = model_and_optimizer(inner, sizes)
        lr, momentum, nesterov = outer
        diloco = DiLoCo(model.parameters(), ReplicaSet(comm, members=members, timeout=60), H, outer_lr=lr,
                        outer_momentum=momentum, nesterov=nesterov, fragments=fragments, comm_hook=comm_hook,
                        join=join)
        return model, optimizer, diloco

    model, optimizer, diloco = build(join=rank == spare)
    hashes = {diloco.syncs: state_hash(diloco)} if rank == spare else {}
    while diloco.inner_steps < steps:
        t = diloco.inner_steps + 1
        if kill is not None and (rank, t) == tuple(kill):
            if not rejoin:
                return None
            kill = None
            model, optimizer, diloco = build(join=True)
            hashes = {diloco.syncs: state_hash(diloco)}  # its life as a joiner
            continue
        inner_step(model, optimizer, rank, t)
        if diloco.step():
            hashes[diloco.syncs] = state_hash(diloco)
    return {"state": diloco.state_arrays(), "local": flatten(diloco.params), "members": diloco.replicas.members,
            "hashes": hashes, "synced": diloco.synced}


def reference(M, H, steps, *, inner="sgd", fragments=1, outer=(0.7, 0.9, True), stops=None):
    """The same DiLoCo in one process: M replicas stepped in a loop, each fragment synced at
    the inner steps t with t = (p + 1) H // F modulo H (Streaming DiLoCo's offsets), the mean of
    theta - theta_i over the replicas that took step t summed in rank order, then the outer
    step by its formula (buf = mu buf + Delta; Nesterov: theta -= lr (Delta + mu buf), else
    theta -= lr buf). ``stops``: {replica: the first inner step it does not take}. Returns the
    global weights (one flat array per fragment) and the outer momentum buffers."""
    lr, mu, nesterov = outer
    stops = stops or {}
    replicas = [model_and_optimizer(inner) for _ in range(M)]
    parts = [split_parameters(model.parameters(), fragments) for model, _ in replicas]
    theta = [flatten(fragment) for fragment in parts[0]]
    buf = [np.zeros_like(t) for t in theta]
    offsets = [(p + 1) * H // fragments for p in range(fragments)]
    for t in range(1, steps + 1):
        alive = [r for r in range(M) if t < stops.get(r, steps + 1)]
        for r in alive:
            inner_step(*replicas[r], r, t)
        for p, offset in enumerate(offsets):
            if t % H != offset % H:
                continue
            total = np.zeros_like(theta[p])
            for r in alive:
                total += theta[p] - flatten(parts[r][p])
            delta = total / len(alive)
            buf[p] = mu * buf[p] + delta
            theta[p] = theta[p] - lr * ((delta + mu * buf[p]) if nesterov else buf[p])
            for r in alive:
                at = 0
                for param in parts[r][p]:
                    param.data[...] = theta[p][at:at + param.data.size].reshape(param.data.shape)
                    at += param.data.size
    return theta, buf


def ddp_replica(comm, steps):
    model, optimizer = model_and_optimizer("sgd")
    ddp = DistributedDataParallel(model, comm, algorithm="ring")
    for t in range(1, steps + 1):
        x, y = data(comm.Get_rank(), t)
        optimizer.zero_grad()
        cross_entropy(ddp(Tensor(x)), y).backward()
        optimizer.step()
    return flatten(model.parameters())


def all_reduce_bytes(world) -> int:
    """The bytes every rank sent in all-reduces (DDP's buckets, DiLoCo's pseudo-gradients)."""
    return sum(m.nbytes for m in world.trace if m.kind == "array" and m.tag in ALL_REDUCE_TAGS)


# ---------------------------------------------------------------------------------------
# The algorithm against its oracles
# ---------------------------------------------------------------------------------------


def test_one_inner_step_with_outer_sgd_at_lr_1_is_ddp():
    """H = 1, outer SGD at lr 1 without momentum, inner SGD without momentum is DDP's step.

    Each replica takes theta_i = theta - eta g_i from the same theta; the pseudo-gradient is
    Delta = theta - mean_i theta_i = eta mean_i g_i; the outer step gives theta - 1 * Delta =
    theta - eta mean_i g_i, which is DDP's update with the averaged gradient. Averaging the
    updated weights equals averaging the gradients because one SGD step is linear in the
    gradient; only the rounding differs (weights are averaged, not gradients), hence 1e-12
    rather than bit equality. Bytes: both all-reduce n float64 values a step with the ring."""
    steps, p = 5, 3
    ddp_world, diloco_world = sim.World(p), sim.World(p)
    ddp = ddp_world.run(ddp_replica, steps)
    local_sgd = diloco_world.run(replica, 1, steps, outer=(1.0, 0.0, False))
    for r in range(p):
        np.testing.assert_allclose(local_sgd[r]["local"], ddp[r], rtol=0, atol=1e-12)
    assert np.abs(local_sgd[0]["local"] - flatten(nn.mlp(SIZES, rng=0, dtype="float64").parameters())).max() > 1e-3
    assert all_reduce_bytes(diloco_world) == all_reduce_bytes(ddp_world) > 0


@pytest.mark.parametrize("inner, fragments, outer", [("adamw", 1, (0.7, 0.9, True)), ("sgd", 1, (0.5, 0.8, False)),
                                                     ("adamw", 3, (0.7, 0.9, True))])
def test_diloco_equals_the_sequential_algorithm(inner, fragments, outer):
    M, H, steps = 3, 4, 12
    results = sim.run(replica, M, H, steps, inner=inner, fragments=fragments, outer=outer)
    theta, buf = reference(M, H, steps, inner=inner, fragments=fragments, outer=outer)
    for result in results:
        state = result["state"]
        for p in range(fragments):
            np.testing.assert_allclose(state[p], theta[p], rtol=0, atol=1e-12)
            np.testing.assert_allclose(state[fragments + p], buf[p], rtol=0, atol=1e-12)
        assert [int(c) for c in state[-1][:2]] == [steps, steps // H * fragments]
    for result in results[1:]:  # the replicas' states are bit-identical
        assert all(np.array_equal(a, b) for a, b in zip(result["state"], results[0]["state"]))


def test_streaming_fragments_each_synced_at_its_schedule_on_the_trace():
    """Rank 0's all-reduce messages, cut into the 2 (p - 1) messages of each ring all-reduce,
    carry 2 (p - 1) / p of one fragment's bytes each, in the order of the schedule."""
    M, H, F, steps = 2, 6, 3, 12
    world = sim.World(M)
    results = world.run(replica, H, steps, fragments=F, outer=(0.7, 0.9, True))
    assert fragment_offsets(F, H) == [2, 4, 6]
    expected = [(t, f) for t in range(1, steps + 1) for f in due_fragments(t, F, H)]
    assert expected == [(2, 0), (4, 1), (6, 2), (8, 0), (10, 1), (12, 2)]
    assert [(t, f) for t, f, _ in results[0]["synced"]] == expected
    sizes = [sum(int(p.data.size) for p in frag)
             for frag in split_parameters(nn.mlp(SIZES, rng=0, dtype="float64").parameters(), F)]
    sent = [m.nbytes for m in world.trace if m.source == 0 and m.kind == "array" and m.tag in ALL_REDUCE_TAGS]
    per_sync = [sum(sent[i:i + 2 * (M - 1)]) for i in range(0, len(sent), 2 * (M - 1))]
    assert per_sync == [8 * sizes[f] * 2 * (M - 1) // M for _, f in expected]
    whole = sum(sizes) * 8 * 2 * (M - 1) // M  # what plain DiLoCo sends at each of its syncs
    assert max(per_sync) < whole / 2  # the peak burst: a fragment, not the model


@pytest.mark.parametrize("H", [2, 5])
def test_bytes_per_worker_are_ddps_divided_by_H(H):
    steps, p = 10, 4
    ddp_world, diloco_world = sim.World(p), sim.World(p)
    ddp_world.run(ddp_replica, steps)
    diloco_world.run(replica, H, steps)
    ddp, diloco = all_reduce_bytes(ddp_world), all_reduce_bytes(diloco_world)
    assert diloco * H == ddp
    for rank in range(p):  # and per worker
        mine = [sum(m.nbytes for m in w.trace if m.source == rank and m.tag in ALL_REDUCE_TAGS)
                for w in (ddp_world, diloco_world)]
        assert mine[1] * H == mine[0]


# ---------------------------------------------------------------------------------------
# Replicas that come and go
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_replica_killed_at_a_random_step_is_dropped(seed):
    """No hang; the survivors' states are bit-identical and equal the sequential algorithm in
    which that replica stops taking steps (and leaves every later average)."""
    rng = np.random.default_rng(seed)
    M, H, steps = 4, 3, 12
    victim, at = int(rng.integers(0, M)), int(rng.integers(2, steps))
    results = sim.World(M, timeout=60).run(replica, H, steps, kill=(victim, at), inner="adamw")
    assert results[victim] is None
    survivors = [r for r in results if r is not None]
    theta, buf = reference(M, H, steps, inner="adamw", stops={victim: at})
    for result in survivors:
        assert result["members"] == [r for r in range(M) if r != victim]
        assert all(np.array_equal(a, b) for a, b in zip(result["state"], survivors[0]["state"]))
    np.testing.assert_allclose(survivors[0]["state"][0], theta[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(survivors[0]["state"][1], buf[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("at", [4, 7, 11])
def test_the_leader_killed_leaves_one_quorum_of_the_others(at):
    """Rank 0 leads every quorum round; killed, the others drop it, the next-lowest leads, and
    it waits for the rest long enough that they too give up on rank 0 first: one quorum of three,
    bit-identical and equal to the sequential run (before the fix, three quorums of one)."""
    M, H, steps = 4, 3, 12
    results = sim.World(M, timeout=60).run(replica, H, steps, kill=(0, at), inner="adamw")
    survivors = results[1:]
    theta, buf = reference(M, H, steps, inner="adamw", stops={0: at})
    for result in survivors:
        assert result["members"] == [1, 2, 3]
        assert all(np.array_equal(a, b) for a, b in zip(result["state"], survivors[0]["state"]))
    np.testing.assert_allclose(survivors[0]["state"][0], theta[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("victim, at", [(2, 5), (3, 9), (0, 7)])
def test_a_restarted_replica_joins_from_a_peer(victim, at):
    """The killed replica starts over with a fresh model, asks to join, and from its first
    sync on its state is bit-identical to the others' at every sync point."""
    M, H, steps = 4, 3, 15
    results = sim.World(M, timeout=60).run(replica, H, steps, kill=(victim, at), rejoin=True, inner="adamw")
    for result in results:
        assert result["members"] == list(range(M))
        assert all(np.array_equal(a, b) for a, b in zip(result["state"], results[0]["state"]))
    joined = results[victim]["hashes"]
    assert min(joined) == (at - 1) // H + 1  # healed at the first sync after its death
    for syncs, digest in joined.items():
        assert all(r["hashes"][syncs] == digest for r in results if syncs in r["hashes"])


def test_a_spare_rank_joins_a_streaming_run():
    M, H, steps = 4, 4, 16
    results = sim.World(M, timeout=60).run(replica, H, steps, fragments=2, members=[0, 1, 2], spare=3)
    assert all(r["members"] == [0, 1, 2, 3] for r in results)
    assert all(all(np.array_equal(a, b) for a, b in zip(r["state"], results[0]["state"])) for r in results)
    assert results[3]["synced"]  # it took part in later syncs


def test_a_joiner_with_another_model_or_config_is_refused_by_name():
    def run(comm):
        rank = comm.Get_rank()
        sizes = [6, 16, 3] if rank == 2 else [6, 8, 3]
        model, optimizer = model_and_optimizer("sgd", sizes)
        H = 5 if rank == 2 else 2
        try:
            diloco = DiLoCo(model.parameters(), ReplicaSet(comm, members=[0, 1], timeout=60), H, join=rank == 2)
        except ReplicaRefused as refused:
            return refused
        t = 0  # the members go on until a quorum has turned the joiner away (its request may come late)
        while t < 6 or (diloco.replicas.refusals == 0 and t < 200):
            t += 1
            inner_step(model, optimizer, rank, t)
            diloco.step()
        return diloco.replicas.members

    results = sim.World(3, timeout=60).run(run)
    refused = results[2]
    assert isinstance(refused, ReplicaRefused) and refused.fields == ("parameters", "sync_every")
    assert "sync_every is 5 here, 2 on the replicas" in str(refused)
    assert results[0] == results[1] == [0, 1]


# ---------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------


def test_fragment_schedule_and_split():
    assert fragment_offsets(1, 5) == [5] and due_fragments(10, 1, 5) == [0] and due_fragments(4, 1, 5) == []
    assert fragment_offsets(4, 8) == [2, 4, 6, 8]
    assert [due_fragments(t, 4, 8) for t in range(1, 9)] == [[], [0], [], [1], [], [2], [], [3]]
    params = nn.mlp(SIZES, rng=0).parameters()
    for F in range(1, 7):
        parts = split_parameters(params, F)
        assert len(parts) == F and all(parts) and [p for part in parts for p in part] == list(params)
    with pytest.raises(ValueError, match="--fragments 5 at most"):
        fragment_offsets(6, 5)
    with pytest.raises(ValueError, match="--fragments 6 at most"):
        split_parameters(params, 7)
    with pytest.raises(ValueError, match="sync_every must be a positive integer"):
        fragment_offsets(1, 0)


def test_replica_group_speaks_in_its_own_ranks():
    def run(comm):
        if comm.Get_rank() == 1:
            return None
        group = ReplicaGroup(comm, [0, 2, 3])
        x = np.full(4, float(comm.Get_rank()))
        from minidist.collectives import all_reduce
        return group.Get_rank(), group.Get_size(), all_reduce(group, x, algorithm="ring")

    results = sim.run(run, 4)
    assert [r[:2] for r in results if r] == [(0, 3), (1, 3), (2, 3)]
    assert all(np.array_equal(r[2], np.full(4, 5.0)) for r in results if r)
    with pytest.raises(ValueError, match="not among the group's ranks"):
        sim.run(lambda comm: ReplicaGroup(comm, [1]) if comm.Get_rank() == 0 else None, 2)


def nearest_e2m1(v, scale):
    """The oracle of the 4-bit floats: each value rounded to the nearest of the 15 signed E2M1
    points times ``scale``, by brute force."""
    grid = np.array([-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6]) * scale
    return grid[np.argmin(np.abs(v[:, None] - grid[None, :]), axis=1)]


def test_fp4_rounds_to_the_nearest_4_bit_float():
    from minidist.parallel.local_sgd.fp4 import decode_fp4, encode_fp4

    v = np.random.default_rng(0).standard_normal(101)
    packed, scale = encode_fp4(v)
    assert packed.size == 51 and packed.dtype == np.uint8 and scale == np.float32(np.abs(v).max() / 6)
    np.testing.assert_array_equal(decode_fp4(packed, scale, v.size), nearest_e2m1(v, np.float64(scale)))
    assert np.abs(decode_fp4(packed, scale, v.size) - v).max() <= scale  # half the widest gap, 4 s to 6 s
    zero, s0 = encode_fp4(np.zeros(4))
    assert s0 == 0 and not decode_fp4(zero, s0, 4).any()
    with pytest.raises(FloatingPointError, match="non-finite"):
        encode_fp4(np.array([1.0, np.inf]))


def test_fp4_hook_averages_the_rounded_rows_and_sends_a_sixteenth():
    """On 3 ranks: the average is the mean of each rank's rounded pseudo-gradient (the oracle
    above), the same bytes on every rank, and each rank sends (p - 1)(ceil(n/2) + 4) bytes."""
    from minidist.parallel.data_parallel.comm_hooks import GradBucket
    from minidist.parallel.local_sgd.fp4 import fp4_compress_hook

    n, p = 37, 3

    def run(comm):
        v = np.random.default_rng(comm.Get_rank()).standard_normal(n)
        return fp4_compress_hook(None, GradBucket(0, v, [], [0], True, comm)).wait()

    world = sim.World(p)
    results = world.run(run)
    rows = []
    for r in range(p):
        v = np.random.default_rng(r).standard_normal(n)
        rows.append(nearest_e2m1(v, np.float64(np.float32(np.abs(v).max() / 6))))
    np.testing.assert_allclose(results[0], np.mean(rows, axis=0), rtol=0, atol=1e-15)
    assert all(np.array_equal(r, results[0]) for r in results)
    for rank in range(p):
        sent = sum(m.nbytes for m in world.trace if m.source == rank and m.kind == "array" and m.tag == 7704)
        assert sent == (p - 1) * ((n + 1) // 2 + 4)


def test_diloco_with_4_bit_outer_gradients_keeps_the_replicas_identical():
    results = sim.run(replica, 3, 3, 9, comm_hook="fp4", inner="adamw")
    assert all(all(np.array_equal(a, b) for a, b in zip(r["state"], results[0]["state"])) for r in results)
    theta, _ = reference(3, 3, 9, inner="adamw")
    error = np.abs(results[0]["state"][0] - theta[0]).max()
    assert 0 < error < 0.05  # rounded, with error feedback: near the float run, not equal


# ---------------------------------------------------------------------------------------
# train --strategy diloco
# ---------------------------------------------------------------------------------------

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "The quick brown fox jumps over the lazy dog; THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG!\n") * 8
TINY = dict(model="gpt", n_layer=2, n_head=2, n_embd=16, block_size=8, batch_size=4, steps=8, eval_every=4, lr=1e-2,
            warmup_steps=2, progress=False)


@pytest.mark.parametrize("fields, ranks, groups", [(dict(sync_every=4), 2, 2),
                                                   (dict(sync_every=4, fragments=2, comm_hook="fp16"), 2, 2),
                                                   (dict(sync_every=2, dp=2), 4, 2)])
def test_train_diloco_on_the_sim(fields, ranks, groups, capsys):
    """The driver on the sim: the GPT trains, every rank ends with the same global weights, the
    syncs and the bytes are the schedule's (a float32 pseudo-gradient of n values, ring all-reduce
    over the replica groups: 2 (G-1)/G 4n bytes per sync of the whole model, fp16 half that; F
    fragments: F syncs of n / F each)."""
    from minidist import train, workloads
    from minidist.parallel.local_sgd.train import train_diloco

    text = workloads.load_text(TEXT)
    config = train.TrainConfig(**TINY, strategy="diloco", **fields)
    results = sim.run(lambda comm: train_diloco(comm, config, text), ranks)
    figures = results[0].figures
    assert results[1] is None and np.isfinite(results[0].val_loss)
    assert figures["replicas_identical"] is True and figures["replicas"] == groups
    assert figures["syncs"] == TINY["steps"] // config.sync_every * config.fragments
    n = sum(int(p.data.size) for p in results[0].model.parameters())
    itemsize = 2 if config.comm_hook == "fp16" else 4
    pseudo_gradients = TINY["steps"] // config.sync_every * 2 * (groups - 1) * n * itemsize // groups
    sent = figures["sync_bytes_per_step"][0] * TINY["steps"]  # the steps' bytes: the start-up broadcast is not
    assert pseudo_gradients <= sent < 1.01 * pseudo_gradients  # in them; the quorum's headers are (a few dozen B)
    assert "diloco:" in capsys.readouterr().out


def test_the_command_line_takes_dilocos_flags_and_refuses_what_it_cannot_do():
    from minidist.cli import train_flags

    parser = train_flags.train_parser()
    config = train_flags.train_config(parser.parse_args(
        ["--strategy", "diloco", "--sync-every", "50", "--outer-lr", "0.7", "--outer-momentum", "0.9", "--nesterov"]))
    assert (config.sync_every, config.outer_lr, config.outer_momentum, config.nesterov) == (50, 0.7, 0.9, True)
    config = train_flags.train_config(parser.parse_args(["--strategy", "diloco", "--no-nesterov", "--fragments", "5"]))
    assert config.nesterov is False and config.fragments == 5
    for argv, message in ((["--fragments", "11"], "--fragments 11 needs --sync-every 11 or more"),
                          (["--precision", "fp16"], "--strategy diloco trains in fp32"),
                          (["--checkpoint-dir", "x"], "does not apply to --strategy diloco")):
        with pytest.raises(ValueError, match=message):
            train_flags.train_config(parser.parse_args(["--strategy", "diloco", *argv]))
    with pytest.raises(ValueError, match="--sync-every applies to --strategy diloco only"):
        train_flags.train_config(parser.parse_args(["--strategy", "ddp", "--sync-every", "5"]))


# ---------------------------------------------------------------------------------------
# Under mpiexec
# ---------------------------------------------------------------------------------------


@pytest.mark.mpi
@requires_mpi
def test_replicas_leave_restart_and_join_under_mpiexec():
    """tests/mpi/local_sgd.py on 4 ranks: H = 1 equals MPI's Allreduce of the weights / 3; then
    rank 2 leaves, rank 1 restarts and rejoins, spare rank 3 joins; the three survivors end with
    bit-identical states (the same hash) and agree on who is there."""
    result = launch.launch(Path(__file__).parent / "mpi" / "local_sgd.py", 4, timeout=120, env=JOB_ENV)
    report = result.stdout + result.stderr[-3000:]
    assert result.ok, f"worker exited with {result.returncode}:\n{report}"
    assert sorted(re.findall(r"H1 OK rank=(\d)", result.stdout)) == ["0", "1", "2"], report
    assert "LEFT rank=2" in result.stdout, report
    # the ranks print at once, so two lines may run together: match each record, not each line
    lines = dict(re.findall(r"REPLICA rank=(\d) (syncs=\d+ members=[\d,]+ hash=[0-9a-f]{64})", result.stdout))
    assert sorted(lines) == ["0", "1", "3"], report
    assert len(set(lines.values())) == 1 and "members=0,1,3" in lines["0"], report

"""FSDP (``minidist.parallel.fsdp``, issue 21): FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2) and
NO_SHARD against one process on the P-times batch (float64, AdamW with clipping, a GPT whose
units' sizes no P in 2..4 divides), bytes per step against the ring's closed forms, what each
rank holds, the prefetch order, bad input, a rank that fails mid-step, and under mpiexec."""
import os
import re
import subprocess
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
from mpitools import JOB_ENV, mpiexec_or_skip

from minidist import memory, nn, optim, sim
from minidist.functions import cross_entropy
from minidist.models.gpt import GPT, GPTConfig
from minidist.parallel.fsdp import FullyShardedDataParallel
from minidist.parallel.fsdp.release import owner
from minidist.tensor import Tensor

CONFIG = GPTConfig(11, 6, 2, 1, 5)  # the root 5 * (11 + 6 + 2) = 95 numbers, each block 365: no P in 2..4 divides
BATCH = 12
STEPS = 3
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


def gpt():
    return GPT(CONFIG, rng=0, dtype="float64")


def batch():
    rng = np.random.default_rng(0)
    return rng.integers(0, 11, (BATCH, 6)), rng.integers(0, 11, (BATCH, 6))


def one_process(clip):
    model, (idx, targets) = gpt(), batch()
    opt = optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        opt.zero_grad()
        model(idx, targets)[1].backward()
        if clip:
            nn.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model.state_dict()


def fsdp_rank(comm, strategy, clip):
    fsdp, (idx, targets) = FullyShardedDataParallel(gpt(), comm, strategy), batch()
    opt = optim.AdamW(fsdp.parameters(), lr=0.01)
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    for _ in range(STEPS):
        before = fsdp.traffic.nbytes
        opt.zero_grad()
        fsdp(idx[rows], targets[rows])[1].backward()
        if clip:
            fsdp.clip_grad_norm_(clip)
        opt.step()
    sent = fsdp.traffic.nbytes - before
    held = {"module": memory.parameter_bytes(fsdp.module), "shards": memory.parameter_bytes(fsdp.parameters()),
            "grads": memory.gradient_bytes(fsdp.parameters()), "state": memory.optimizer_state_bytes(opt)}
    return fsdp.full_state_dict(), sent, [u.flat.nbytes for u in fsdp.units], held


def ring_all_reduce_bytes(numel, p, rank, itemsize=8):
    """A ring all-reduce of numel numbers cut by numpy.array_split sends every chunk but its own
    (reduce-scatter) and every chunk but the next rank's (all-gather)."""
    sizes = [len(c) for c in np.array_split(np.arange(numel), p)]
    return 0 if p == 1 else (2 * numel - sizes[rank] - sizes[(rank + 1) % p]) * itemsize


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fsdp_follows_one_process_with_clipping(strategy, world_size):
    reference = one_process(clip=0.5)
    for state, _, _, _ in sim.run(fsdp_rank, world_size, strategy, 0.5):
        assert list(state) == list(reference)  # the module's own names, the tied head included
        assert max(float(np.abs(state[k] - reference[k]).max()) for k in reference) < 1e-10


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bytes_per_step_are_the_closed_forms_and_each_rank_holds_one_pth(world_size):
    reference = one_process(clip=None)
    p = world_size
    for strategy, gathers in (("FULL_SHARD", 3), ("SHARD_GRAD_OP", 2)):
        for state, sent, unit_bytes, held in sim.run(fsdp_rank, p, strategy, None):
            assert max(float(np.abs(state[k] - reference[k]).max()) for k in reference) < 1e-10
            psi = sum(unit_bytes)  # every unit padded to a multiple of P
            assert all(b % (8 * p) == 0 for b in unit_bytes) and psi >= gpt().num_parameters() * 8
            assert sent == gathers * psi * (p - 1) // p  # all-gathers and one reduce-scatter, ring
            assert held["module"] == 0  # between steps the module's parameters are freed
            assert held["shards"] == held["grads"] == psi // p and held["state"] == 2 * psi // p
    for rank, (_, sent, unit_bytes, held) in enumerate(sim.run(fsdp_rank, p, "NO_SHARD", None)):
        assert sent == sum(ring_all_reduce_bytes(b // 8, p, rank) for b in unit_bytes)  # DDP's all-reduce
        assert held["shards"] == held["grads"] == sum(unit_bytes) and held["state"] == 2 * sum(unit_bytes)


def test_the_mlp_is_one_unit_and_follows_one_process():
    X, Y = np.random.default_rng(0).standard_normal((12, 6)), np.random.default_rng(1).integers(0, 3, 12)

    def train(model, params, step_rows):
        opt = optim.SGD(params, lr=0.1, momentum=0.9)
        for _ in range(STEPS):
            opt.zero_grad()
            cross_entropy(model(Tensor(X[step_rows])), Y[step_rows]).backward()
            opt.step()

    dense = nn.mlp([6, 5, 3], rng=0, dtype="float64")
    train(dense, dense.parameters(), slice(None))

    def rank(comm):
        fsdp = FullyShardedDataParallel(nn.mlp([6, 5, 3], rng=0, dtype="float64"), comm)
        r, size = comm.Get_rank(), comm.Get_size()
        train(fsdp, fsdp.parameters(), slice(r * 12 // size, (r + 1) * 12 // size))
        return [u.name for u in fsdp.units], fsdp.full_state_dict()

    for names, state in sim.run(rank, 3):
        assert names == ["root"]
        assert all(np.abs(state[k] - v).max() < 1e-10 for k, v in dense.state_dict().items())


@pytest.mark.parametrize("strategy, kept", [("FULL_SHARD", False), ("SHARD_GRAD_OP", True)])
def test_between_its_forward_and_its_backward_a_unit_holds_its_shard_only(strategy, kept):
    """FULL_SHARD: once the forward is over, no gathered vector is alive (the graph's saved
    weights were swapped for holes, release.py), yet the backward gives one process's gradients
    (the tests above); SHARD_GRAD_OP keeps every unit's vector until its gradients are reduced."""
    def rank(comm):
        fsdp, (idx, targets) = FullyShardedDataParallel(gpt(), comm, strategy), batch()
        vectors = []
        for unit in fsdp.units:
            def gather(unit=unit, original=unit.gather):
                gathered = original()
                if gathered:
                    vectors.append(weakref.ref(owner(unit.full)))  # the memory, not a view
                return gathered
            unit.gather = gather
        _, loss = fsdp(idx, targets)
        alive = [ref() is not None for ref in vectors]
        loss.backward()
        return alive, len(vectors), all(ref() is None for ref in vectors)

    for alive, gathered, freed_after_backward in sim.run(rank, 2):
        assert gathered == (3 if kept else 6) and alive == [kept] * 3 and freed_after_backward


def test_forward_prefetch_starts_the_next_units_all_gather_in_the_order_of_the_last_forward():
    def rank(comm):
        fsdp, (idx, targets) = FullyShardedDataParallel(gpt(), comm), batch()
        for _ in range(2):
            fsdp(idx, targets)[1].backward()
            fsdp.zero_grad()
        return fsdp.gathers, fsdp.prefetch_order

    gathers, prefetched = sim.run(rank, 2)[0]
    first = [("forward", "root"), ("forward", "transformer.h.0"), ("forward", "transformer.h.1"),
             ("backward", "root"), ("backward", "transformer.h.1"), ("backward", "transformer.h.0")]
    second = [("forward", "root"), ("prefetch", "transformer.h.0"), ("forward", "transformer.h.0"),
              ("prefetch", "transformer.h.1"), ("forward", "transformer.h.1"), *first[3:]]
    assert gathers == first + second  # the first forward has no order to go by yet
    assert prefetched == ["transformer.h.0", "transformer.h.1"]


def test_bad_input_names_the_fix_on_every_rank():
    with pytest.raises(ValueError, match="unknown sharding_strategy 'ZERO3'; use one of FULL_SHARD"):
        sim.run(lambda comm: FullyShardedDataParallel(gpt(), comm, "ZERO3"), 2)
    with pytest.raises(ValueError, match="has no parameters"):
        sim.run(lambda comm: FullyShardedDataParallel(nn.ReLU(), comm), 2)
    with pytest.raises(ValueError, match="disagree on the model or the sharding strategy"):
        sim.run(lambda comm: FullyShardedDataParallel(gpt(), comm, STRATEGIES[comm.Get_rank()]), 2)


def fail_in_block_1(fsdp, comm):
    """Make rank 1's second block raise from its MLP's forward (after the first blocks' all-gathers)."""
    if comm.Get_rank() == 1:
        def fail(x):
            raise ValueError("rank 1 failed mid-forward")
        fsdp.module.transformer.h[1].mlp.forward = fail


def test_a_rank_that_raises_mid_step_ends_every_rank_with_its_error():
    def rank(comm):
        fsdp, (idx, targets) = FullyShardedDataParallel(gpt(), comm), batch()
        fsdp(idx, targets)[1].backward()
        fail_in_block_1(fsdp, comm)
        fsdp(idx, targets)[1].backward()

    start = time.perf_counter()
    with pytest.raises(ValueError, match="rank 1 failed mid-forward") as info:
        sim.World(2, timeout=30).run(rank)
    assert info.value.rank == 1 and time.perf_counter() - start < 10


MPI_SCRIPT = """
from mpi4py import MPI
import numpy as np
import test_fsdp as t
import test_zero as z
comm = MPI.COMM_WORLD
reference = t.one_process(clip=0.5)
for strategy in t.STRATEGIES:
    state, sent, unit_bytes, _ = t.fsdp_rank(comm, strategy, 0.5)
    error = max(float(np.abs(state[k] - reference[k]).max()) for k in reference)
    print(f"rank {comm.Get_rank()} {strategy} error {error:.1e} sent {sent} psi {sum(unit_bytes)}", flush=True)
reference = z.one_process(z.optim.AdamW, lr=0.01, weight_decay=0.1)
params, sent, psi = z.zero_reducing_rank(comm)
error = max(float(np.abs(a - b).max()) for a, b in zip(params, reference))
print(f"rank {comm.Get_rank()} ZERO1 error {error:.1e} sent {sent} psi {psi}", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fsdp_follows_one_process_under_mpiexec(tmp_path, world_size):
    """Real ranks: every strategy, and ZeRO-1 reducing the gradients itself, equals one process
    to 1e-10; FULL_SHARD sends 3(P-1)/P Ψ and ZeRO-1 2(P-1)/P Ψ, plus the clipping's number."""
    script = tmp_path / "fsdp_mpi.py"
    script.write_text(MPI_SCRIPT)
    env = {**os.environ, **JOB_ENV, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                                     os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([mpiexec_or_skip(), "-n", str(world_size), sys.executable, "-m", "mpi4py", str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = re.findall(r"rank (\d) (\w+) error (\S+) sent (\d+) psi (\d+)", run.stdout)  # ranks' lines may meet
    assert len(lines) == 4 * world_size and all(float(error) < 1e-10 for _, _, error, _, _ in lines)
    for _, strategy, _, sent, psi in lines:
        gathers = {"FULL_SHARD": 3, "ZERO1": 2}.get(strategy)
        if gathers:
            # the norm's all-reduce: one number, sent once or twice (recursive doubling)
            assert int(sent) - gathers * int(psi) * (world_size - 1) // world_size in (8, 16)

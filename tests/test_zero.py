"""ZeRO-1 (``minidist.parallel.zero``, issue 21): the flat padded layout, and
``ZeroRedundancyOptimizer`` under DDP against one process on the P-times batch (float64, an MLP
of 53 parameters, which no P in 2..4 divides), its bytes and its share of the optimizer state."""
import numpy as np
import pytest

from minidist import memory, nn, optim, sim
from minidist.functions import cross_entropy
from minidist.parallel.data_parallel import DistributedDataParallel
from minidist.parallel.zero import FlatParameter, ZeroRedundancyOptimizer, optimizer_defaults
from minidist.tensor import Tensor
from minidist.tracing import CountingComm

X = np.random.default_rng(0).standard_normal((24, 6))
Y = np.random.default_rng(1).integers(0, 3, 24)
STEPS = 4


def mlp():
    return nn.mlp([6, 5, 3], rng=0, dtype="float64")  # 53 parameters: no P in 2..4 divides


def one_process(optimizer_class, **defaults):
    model = mlp()
    opt = optimizer_class(model.parameters(), **defaults)
    for _ in range(STEPS):
        opt.zero_grad()
        cross_entropy(model(Tensor(X)), Y).backward()
        nn.clip_grad_norm_(opt.params, 0.5)
        opt.step()
    return [p.data for p in model.parameters()]


def zero_rank(comm, optimizer_class, defaults):
    traffic = CountingComm(comm)
    ddp = DistributedDataParallel(mlp(), traffic, algorithm="ring")
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class, traffic, **defaults)
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = slice(rank * len(X) // size, (rank + 1) * len(X) // size)
    for _ in range(STEPS):
        zero.zero_grad()
        ddp_before, before = ddp.stats.bytes_sent, traffic.nbytes
        cross_entropy(ddp(Tensor(X[rows])), Y[rows]).backward()
        nn.clip_grad_norm_(zero.params, 0.5)  # the training loop clips optimizer.params
        zero.step()
    sent, ddp_sent = traffic.nbytes - before, ddp.stats.bytes_sent - ddp_before
    assert memory.optimizer_state_bytes(zero) == memory.optimizer_state_bytes(zero.optim)  # the wrapper: its inner
    return ([p.data for p in ddp.parameters()], sent, ddp_sent, zero.flat.nbytes,
            memory.optimizer_state_bytes(zero.optim), zero.shard.size)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("optimizer_class, defaults", [(optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
                                                       (optim.SGD, {"lr": 0.1, "momentum": 0.9})])
def test_zero1_follows_one_process_and_sends_the_all_reduce_plus_one_all_gather(world_size, optimizer_class,
                                                                               defaults):
    reference = one_process(optimizer_class, **defaults)
    padded = -(-53 // world_size) * world_size
    for params, sent, ddp_sent, psi, state, shard in sim.run(zero_rank, world_size, optimizer_class, defaults):
        assert max(float(np.abs(a - b).max()) for a, b in zip(params, reference)) < 1e-10
        assert psi == padded * 8 and shard == padded // world_size
        # DDP's ring all-reduce, then one ring all-gather of the padded vector: (P-1)/P Ψ more
        assert sent == ddp_sent + psi * (world_size - 1) // world_size
        per_element = 2 if optimizer_class is optim.AdamW else 1  # moments, or momentum: of the shard only
        assert state == per_element * shard * 8


def zero_reducing_rank(comm):
    """ZeRO-1 as the paper counts it: DDP's all-reduce skipped (no_sync), the optimizer
    reduce-scatters the local gradients, clips over the shards, steps and all-gathers."""
    traffic = CountingComm(comm)
    ddp = DistributedDataParallel(mlp(), traffic)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optim.AdamW, traffic, reduce_gradients=True, lr=0.01,
                                   weight_decay=0.1)
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = slice(rank * len(X) // size, (rank + 1) * len(X) // size)
    for _ in range(STEPS):
        zero.zero_grad()
        before = traffic.nbytes
        with ddp.no_sync():
            cross_entropy(ddp(Tensor(X[rows])), Y[rows]).backward()
        zero.clip_grad_norm_(0.5)
        zero.step()
    return [p.data for p in ddp.parameters()], traffic.nbytes - before, zero.flat.nbytes


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_zero1_reducing_the_gradients_itself_sends_two_psi(world_size):
    reference = one_process(optim.AdamW, lr=0.01, weight_decay=0.1)
    for rank, (params, sent, psi) in enumerate(sim.run(zero_reducing_rank, world_size)):
        assert max(float(np.abs(a - b).max()) for a, b in zip(params, reference)) < 1e-10
        # a ring reduce-scatter and a ring all-gather of Ψ, (P-1)/P each; the norm, one float64 in a ring all-reduce,
        # sends its one chunk (rank 0's) but from rank 0 in the reduce-scatter and to rank 0 in the all-gather
        chunk = [1] + [0] * (world_size - 1)
        norm = 0 if world_size == 1 else 8 * (2 - chunk[rank] - chunk[(rank + 1) % world_size])
        assert sent == 2 * psi * (world_size - 1) // world_size + norm


def test_each_rank_steps_only_its_shard_and_the_state_round_trips():
    def rank(comm):
        model = mlp()
        zero = ZeroRedundancyOptimizer(model.parameters(), optim.AdamW, comm, lr=0.01)
        for p in model.parameters():
            p.grad = np.ones_like(p.data)
        zero.step()
        saved = zero.state_dict()
        zero.lr = 0.5
        zero.load_state_dict(saved)
        return zero.lr, saved["exp_avg"][0].shape, zero.flat.shard_bounds(comm.Get_rank())

    out = sim.run(rank, 3)
    assert [o[1] for o in out] == [(18,)] * 3 and [o[2] for o in out] == [(0, 18), (18, 36), (36, 54)]
    assert all(lr == 0.01 for lr, _, _ in out)


def test_the_flat_layout_pads_to_equal_shards():
    params = [Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True), Tensor(np.arange(5.0), requires_grad=True)]
    flat = FlatParameter(params, 4)
    assert (flat.numel, flat.padded, flat.shard_size, flat.offsets) == (11, 12, 3, [0, 6, 11])
    vector = flat.flatten([p.data for p in params])
    assert vector.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0]
    assert [v.shape for v in flat.views(vector)] == [(2, 3), (5,)]
    with pytest.raises(ValueError, match="module without parameters"):
        FlatParameter([], 2)


def test_optimizer_defaults_reads_the_hyperparameters_back():
    opt = optim.AdamW(mlp().parameters(), lr=0.02, weight_decay=0.3)
    assert optimizer_defaults(opt) == {"lr": 0.02, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.3}


def test_bad_input_is_refused_on_every_rank():
    with pytest.raises(ValueError, match="no parameters"):
        sim.run(lambda comm: ZeroRedundancyOptimizer([], optim.SGD, comm, lr=0.1), 2)

    def disagree(comm):
        model = nn.mlp([6, 5 + comm.Get_rank(), 3], rng=0)
        ZeroRedundancyOptimizer(model.parameters(), optim.SGD, comm, lr=0.1)

    with pytest.raises(ValueError, match="disagree"):
        sim.run(disagree, 2)

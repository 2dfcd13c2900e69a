"""DiLoCo's replicas coming and going under real mpiexec (4 ranks; tests/test_local_sgd.py
launches it): ranks 0, 1, 2 start as replicas and rank 3 as a spare.

- rank 3 asks to join at once and is healed from a peer at the next sync point;
- rank 2 leaves before inner step LEAVE (it stops answering and waits in MPI_Finalize: the job
  goes on, the survivors drop it after the leader's deadline, TIMEOUT seconds);
- rank 1 "restarts" before inner step RESTART: it throws its model and optimizer away, builds
  fresh ones and joins again, receiving the state from a healthy peer (no checkpoint read).

At the end each replica prints ``REPLICA rank=R syncs=S members=M hash=H`` (H: SHA-256 of its
shared state: global weights, outer momentum, counters); the test checks the survivors' lines
agree and the leaver printed ``LEFT``. Also checked: DiLoCo with H = 1 and outer SGD at lr 1 on
the three starting replicas equals MPI's own Allreduce of the updated weights / 3 (``H1 OK``).

    mpiexec -n 4 python -m mpi4py tests/mpi/local_sgd.py
"""
import hashlib

import numpy as np

from minidist import nn, optim
from minidist.functions import cross_entropy
from minidist.parallel.local_sgd import DiLoCo, ReplicaSet, flatten
from minidist.tensor import Tensor

H, STEPS, LEAVE, RESTART, TIMEOUT = 3, 24, 5, 11, 4.0
SIZES = [6, 16, 3]


def batch(rank, step):
    rng = np.random.default_rng(1000 * rank + step)
    return rng.standard_normal((8, SIZES[0])), rng.integers(0, SIZES[-1], 8)


def inner_step(model, optimizer, rank, step):
    x, y = batch(rank, step)
    optimizer.zero_grad()
    cross_entropy(model(Tensor(x)), y).backward()
    optimizer.step()


def build(comm, members, join, sync_every=H, outer=(0.7, 0.9, True)):
    model = nn.mlp(SIZES, rng=0, dtype="float64")
    optimizer = optim.AdamW(model.parameters(), lr=1e-2)
    lr, momentum, nesterov = outer
    diloco = DiLoCo(model.parameters(), ReplicaSet(comm, members=members, timeout=TIMEOUT), sync_every, outer_lr=lr,
                    outer_momentum=momentum, nesterov=nesterov, join=join)
    return model, optimizer, diloco


def averaging_equals_allreduce(comm):
    """H = 1, outer lr 1, no momentum: the new weights are the mean of the replicas' updated
    weights; MPI's Allreduce computes that mean independently."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    group = comm.Split(0 if rank < 3 else MPI.UNDEFINED)  # collective: every rank calls it
    if rank == 3:
        return
    members = [0, 1, 2]
    model, optimizer, diloco = build(comm, members, False, sync_every=1, outer=(1.0, 0.0, False))
    inner_step(model, optimizer, rank, 1)
    updated = flatten(diloco.params)
    mean = np.empty_like(updated)
    group.Allreduce(updated, mean, op=MPI.SUM)
    group.Free()
    diloco.step()
    assert np.abs(flatten(diloco.params) - mean / 3).max() < 1e-12, "H = 1 differs from the averaged weights"
    print(f"H1 OK rank={rank}", flush=True)


def main():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    assert comm.Get_size() == 4, "run on 4 ranks"
    averaging_equals_allreduce(comm)
    comm.Barrier()
    members = [0, 1, 2]
    model, optimizer, diloco = build(comm, members, join=rank == 3)
    while diloco.inner_steps < STEPS:
        t = diloco.inner_steps + 1
        if rank == 2 and t == LEAVE:
            print("LEFT rank=2", flush=True)
            return
        if rank == 1 and t == RESTART and not getattr(main, "restarted", False):
            main.restarted = True
            model, optimizer, diloco = build(comm, members, join=True)
            continue
        inner_step(model, optimizer, rank, t)
        diloco.step()
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in diloco.state_arrays())).hexdigest()
    members = ",".join(map(str, diloco.replicas.members))
    print(f"REPLICA rank={rank} syncs={diloco.syncs} members={members} hash={digest}", flush=True)


if __name__ == "__main__":
    main()

"""all_to_all and all_to_all_v under mpiexec, against MPI's own Alltoall and Alltoallv.

    mpiexec -n P python -m mpi4py tests/mpi/all_to_all_cases.py

Every process builds every rank's input from a seed (:func:`row_counts`, :func:`blocks`), so
the inputs need no message. For each dtype and trailing shape, minidist's all_to_all (even
blocks, 0 rows included) is compared bit for bit with ``comm.Alltoall`` and all_to_all_v
(uneven rows, zeros included, one case all zeros) with ``comm.Alltoallv``; then ranks that
disagree (another trailing shape, another first axis) must raise the same CollectiveError on
every rank, and a good call after them must still work. Rank 0 prints one line per problem
and ends with "ALL OK ranks=P cases=N" or "FAILED problems=K". tests/test_all_to_all.py runs
it for P = 2 and 4 (P = 3 passes too, by hand: each launch costs seconds); its sim tests use
:func:`blocks` too, with the transpose as the oracle.
"""
import zlib

import numpy as np

DTYPES = ("bool", "int8", "int32", "int64", "float32", "float64", "complex128")
TRAILING = ((), (3,), (2, 5))


def rng_for(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def values(rng, shape, dtype):
    """Random values of any dtype the collectives move."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(-100, 100, shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def row_counts(p, seed):
    """counts[i][j]: the rows rank i sends rank j, 0 to 4, with at least one 0 (seed -1: all 0)."""
    if seed == -1:
        return np.zeros((p, p), np.int64)
    counts = rng_for("counts", p, seed).integers(0, 5, (p, p))
    counts[seed % p, (seed + 1) % p] = 0
    return counts


def blocks(rank, counts, trailing, dtype, seed):
    """Rank ``rank``'s all_to_all_v input: block j has counts[rank][j] rows of shape ``trailing``."""
    return [values(rng_for("block", seed, rank, j), (int(n),) + tuple(trailing), dtype)
            for j, n in enumerate(counts[rank])]


def differs(ours, theirs):
    """Why two arrays are not the same bytes, shape and dtype (None when they are)."""
    if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        return f"shape/dtype {ours.shape} {ours.dtype} against {theirs.shape} {theirs.dtype}"
    if ours.tobytes() != theirs.tobytes():
        return "different values"
    return None


def against_mpi(comm, collectives):
    """Problems comparing both collectives with MPI's Alltoall/Alltoallv; and the case count."""
    rank, p = comm.Get_rank(), comm.Get_size()
    problems, cases = [], 0
    for dtype in DTYPES:
        for trailing in TRAILING:
            for rows in (0, 1, 3):
                x = values(rng_for("even", dtype, trailing, rows, rank), (p, rows) + trailing, dtype)
                theirs = np.empty_like(x)
                comm.Alltoall(x, theirs)
                how = differs(collectives.all_to_all(comm, x), theirs)
                problems += [f"all_to_all {dtype} {trailing} rows={rows}: {how}"] if how else []
                cases += 1
            for seed in (-1, 0, 1):
                counts = row_counts(p, seed)
                mine = blocks(rank, counts, trailing, dtype, seed)
                size = int(np.prod(trailing, dtype=np.int64))
                sent, got = counts[rank] * size, counts[:, rank] * size  # elements, as MPI counts
                received = np.empty(int(got.sum()), dtype)
                comm.Alltoallv([np.concatenate([b.reshape(-1) for b in mine]), (sent, _offsets(sent))],
                               [received, (got, _offsets(got))])
                ours = collectives.all_to_all_v(comm, mine)
                for i, (a, b) in enumerate(zip(_offsets(got), _offsets(got) + got)):
                    how = differs(ours[i], received[a:b].reshape((int(counts[i, rank]),) + trailing))
                    problems += [f"all_to_all_v {dtype} {trailing} seed={seed} block {i}: {how}"] if how else []
                cases += 1
    return problems, cases


def _offsets(counts):
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def disagreements(comm, collectives, error):
    """Each call's error message on this rank (None when it did not raise), for calls the ranks
    disagree on; then a good all_to_all's problem or None."""
    rank, p = comm.Get_rank(), comm.Get_size()
    calls = {
        "trailing shape": lambda: collectives.all_to_all_v(comm, [np.zeros((1, 2 + rank))] * p),
        "dtype": lambda: collectives.all_to_all_v(comm, [np.zeros(2, "f4" if rank else "f8")] * p),
        "first axis": lambda: collectives.all_to_all(comm, np.zeros((p + (rank == 0), 2))),
    }
    found = {}
    for name, call in calls.items():
        try:
            call()
            found[name] = None
        except error as exc:
            found[name] = str(exc)
    x = np.arange(p, dtype=np.int64) + 10 * rank
    good = collectives.all_to_all(comm, x)
    return found, differs(good, np.arange(p, dtype=np.int64) * 10 + rank)


def main():
    from mpi4py import MPI

    from minidist import collectives, p2p

    comm = MPI.COMM_WORLD
    p2p.set_timeout(60)
    problems, cases = against_mpi(comm, collectives)
    found, after = disagreements(comm, collectives, p2p.CollectiveError)
    problems += [f"after the disagreements: {after}"] if after else []
    everyone = comm.gather((problems, found), root=0)
    if comm.Get_rank() != 0:
        return
    problems = [f"rank {r}: {m}" for r, (mine, _) in enumerate(everyone) for m in mine]
    for name in found:
        messages = {seen[name] for _, seen in everyone}
        if len(messages) != 1 or None in messages:
            problems.append(f"{name}: not the same CollectiveError on every rank: {messages}")
    print("\n".join(problems + [f"MESSAGE {name}: {message}" for name, message in found.items()]))
    print(f"ALL OK ranks={comm.Get_size()} cases={cases}" if not problems else f"FAILED problems={len(problems)}")


if __name__ == "__main__":
    main()

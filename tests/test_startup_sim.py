"""Start-up on the simulator (issue 18): the pipeline grid meets its ranks with a deadline
before ``comm.Split``, and checks that they ask for the same grid."""
import time

import pytest

from minidist import p2p, sim
from minidist.parallel.pipeline.grid import ProcessGrid


def test_a_rank_that_never_reaches_the_grid_is_named_within_the_deadline():
    # before: the others entered comm.Split, which has no deadline
    def rank(comm):
        if comm.Get_rank() == 3:  # busy elsewhere (a returned rank would be the sim's deadlock instead)
            time.sleep(2)
            return None
        start = time.perf_counter()
        try:
            ProcessGrid.create(comm, 2)
        except p2p.CollectiveTimeout as error:
            return error.missing, str(error), time.perf_counter() - start

    # set once, here: the deadline is the process's, and ranks restoring it in turn could leave 0.5 s behind
    previous = p2p.set_timeout(0.5)
    try:
        results = sim.run(rank, 4)
    finally:
        p2p.set_timeout(previous)
    for missing, message, seconds in results[:3]:
        assert missing == [3] and message.startswith("pipeline grid (before comm.Split): ")
        assert 0.5 <= seconds < 1.5


def test_ranks_that_ask_for_different_grids_fail_alike_before_splitting():
    # before: rank 0 split into 2 pipelines of 2, the others into 1 of 4: mismatched communicators
    def rank(comm):
        with pytest.raises(p2p.CollectiveError, match=r"different numbers of pipelines \(--dp\): \[2, 1, 1, 1\]"):
            ProcessGrid.create(comm, 2 if comm.Get_rank() == 0 else 1)
        return True

    assert sim.run(rank, 4) == [True] * 4


def test_the_grid_still_splits_as_before():
    grids = sim.run(lambda comm: ProcessGrid.create(comm, 2), 4)
    assert [(g.dp_rank, g.pp_rank, g.pp_comm.Get_rank(), g.dp_comm.Get_rank()) for g in grids] == [
        (0, 0, 0, 0), (0, 1, 1, 0), (1, 0, 0, 1), (1, 1, 1, 1)]

"""mpi4py's own Comm.Split as the oracle for the sim's (run by tests/test_sim_split.py under
mpiexec -n 4): the same split_case, the answers worked out from MPI's rules. Prints
'SPLIT OK' on rank 0, or what differs."""
import sys
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_sim_split as T

comm = MPI.COMM_WORLD
seen = T.split_case(comm, undefined=MPI.UNDEFINED)
found = comm.gather(seen, root=0)
if comm.Get_rank() == 0:
    expected = T.expected_split_case(comm.Get_size())
    print("SPLIT OK" if found == expected else f"differs:\n  mpi4py: {found}\n  expected: {expected}")

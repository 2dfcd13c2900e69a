"""Idle links: broadcast and all-reduce over packed spanning trees (Blink).

A ring collective runs at its slowest link and needs a ring: a cycle through every GPU over
the fast links. Give a job 5 of a DGX-1's 8 GPUs, say 0, 1, 2, 3 and 5, and there is none
(GPU 5's only NVLink in the set goes to GPU 1), so NCCL falls back to PCIe, and NVLinks sit
idle. Trees need no cycle. Wang et al., "Blink: Fast and Generic Collectives for Distributed
ML" (MLSys 2020) broadcast over several spanning trees at once, each carrying a share of the
data in proportion to its rate, packed so that together they reach the best rate the links
allow; all-reduce is a reduce up the same trees, then a broadcast down; and PCIe, idle too,
carries one more tree.

    import numpy
    from minidist import blink, sim
    topo = sim.Topology.dgx1(gpus=(0, 1, 2, 3, 5))      # ranks 0..4 = GPUs 0, 1, 2, 3, 5
    blink.hamiltonian_cycles(topo)                        # []: no NVLink ring
    blink.broadcast_bound(topo, root=0)                   # 50e9 B/s: GPU 5's two NVLinks to GPU 1
    packing = blink.pack_trees(topo, root=0)              # arborescences reaching it: .rate == .bound
    hybrid = blink.pack_trees(topo, root=0, pcie=True)    # plus a PCIe chain: 62e9 B/s
    world = sim.World(5, topology=topo)
    x = numpy.arange(1 << 20, dtype=numpy.float32)
    world.run(lambda comm: blink.broadcast_trees(comm, x, 0, hybrid))   # x on every rank
    world.makespan                                        # about x.nbytes / 62e9 + pipeline fill
    world.run(lambda comm: blink.all_reduce_trees(comm, x, hybrid, op="sum"))

What is what (each function's docstring has its cost and source):
- :func:`broadcast_bound`: the best broadcast rate from a root, min over the other ranks of
  the max-flow to them (networkx). No schedule can beat it: every byte reaches every rank
  through that rank's min cut. Edmonds (1973): packed arborescences reach it exactly.
- :func:`pack_trees`: a :class:`Packing` of :class:`Tree`\\ s (arborescences from the root)
  whose rates add up to exactly the bound (Lovász's constructive proof of Edmonds' theorem;
  ``pcie=True`` adds a PCIe chain).
- :func:`broadcast_trees`, :func:`all_reduce_trees`: the collectives, pipelined in chunks
  down (and up) every tree at once, equal to ``collectives.broadcast`` / ``all_reduce``.
- :func:`hamiltonian_cycles`, :func:`ring_rate`: the rings a ring collective could use.
"""

"""Data-parallel serving: replicas of the whole model behind one front.

Replicas (the book's chapter 3: each rank holds the whole model and
serves its own requests): :class:`ReplicaFront` on rank 0 takes requests with the Scheduler's
``add``/``cancel``/``step``/``has_work``, hands each to the replica with the fewest unfinished
requests, and every ``step`` is one round: the front scatters the new commands, each replica runs
one step of its own scheduler, the front gathers their events. The other ranks run
:func:`serve_replica` until the front's :meth:`ReplicaFront.close`. The front's
``step`` is one scatter and one gather of small pickled records (the commands, the events: a few
bytes per token), and every replica's step is as long as the slowest's.

A replica may itself be a tensor-parallel group (:mod:`minidist.serving.tp_decode`): its ranks
would take the front's commands from their group's first rank, as a DeviceMesh's dp x tp layout.
"""
from __future__ import annotations

import numpy as np

from minidist.collectives import gather_objects, scatter_objects
from minidist.serving.scheduler import check_request


class ReplicaFront:
    """Data-parallel serving's front, on rank 0 of ``comm`` (module docstring): the Scheduler's
    interface (``add``, ``cancel``, ``step``, ``has_work``) over one scheduler per rank, rank 0's
    own ``scheduler`` included; the other ranks run :func:`serve_replica`. Request ids are the
    front's. Each request goes to the replica with the fewest unfinished requests (the lowest rank
    on a tie). ``step`` and ``close`` are collective over ``comm``. ``add`` raises ValueError as the
    Scheduler's does (checked here, against rank 0's model)."""

    def __init__(self, comm, scheduler):
        self.comm, self.scheduler = comm, scheduler
        self.size = comm.Get_size()
        self.commands = [[] for _ in range(self.size)]  # per replica: ("add", id, request), ("cancel", id)
        self.where: dict[int, int] = {}  # unfinished request id -> its replica
        self.next_id = 0
        self.served = [0] * self.size  # requests each replica was given
        self.front_ids: dict[int, int] = {}  # rank 0's scheduler's ids -> the front's

    def add(self, request) -> int:
        """Queue ``request`` for the least-loaded replica; returns its id."""
        check_request(request, self.scheduler.config)
        load = [0] * self.size
        for replica in self.where.values():
            load[replica] += 1
        replica = int(np.argmin(load))
        request_id, self.next_id = self.next_id, self.next_id + 1
        self.commands[replica].append(("add", request_id, request))
        self.where[request_id] = replica
        self.served[replica] += 1
        return request_id

    def cancel(self, request_id: int) -> None:
        """Cancel ``request_id`` on its replica at the next step; unknown ids ignored."""
        if request_id in self.where:
            self.commands[self.where[request_id]].append(("cancel", request_id))

    def has_work(self) -> bool:
        """True while a request is unfinished."""
        return bool(self.where)

    def step(self) -> list:
        """One round: the commands out, one step on every replica, the events back (collective)."""
        commands, self.commands = self.commands, [[] for _ in range(self.size)]
        mine, _ = scatter_objects(self.comm, commands, info="step")
        everyone = gather_objects(self.comm, replica_step(self.scheduler, mine, self.front_ids))
        events = [event for replica_events in everyone for event in replica_events]
        for event in events:
            if event.finished:
                self.where.pop(event.request_id, None)
        return events

    def close(self) -> None:
        """Stop the other ranks' :func:`serve_replica` loops (collective)."""
        scatter_objects(self.comm, None, info="close")


def replica_step(scheduler, commands, front_ids: dict) -> list:
    """Apply the front's ``commands`` to ``scheduler`` and run one step; returns the events with the
    front's request ids. ``front_ids`` maps the scheduler's ids to the front's (updated here)."""
    local_ids = {front: local for local, front in front_ids.items()}
    for command in commands:
        if command[0] == "add":
            front_ids[scheduler.add(command[2])] = command[1]
        elif command[1] in local_ids:
            scheduler.cancel(local_ids[command[1]])
    events = scheduler.step() if scheduler.has_work() else []
    for event in events:
        event.request_id = front_ids[event.request_id] if not event.finished else front_ids.pop(event.request_id)
    return events


def serve_replica(comm, scheduler) -> int:
    """A replica's loop on a rank other than the front's: take the front's commands, step, send the
    events, until the front closes. Returns the number of steps run (collective)."""
    steps, front_ids = 0, {}
    while True:
        commands, what = scatter_objects(comm, None)
        if what == "close":
            return steps
        gather_objects(comm, replica_step(scheduler, commands, front_ids))
        steps += 1

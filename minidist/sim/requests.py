"""The sim's pending operations: :class:`Request` (``Isend``/``Irecv`` and the lowercase
``isend``/``irecv``, completed by ``Wait``/``Test`` as mpi4py's), :class:`Status`, and
:func:`wait_all`, the wait with a deadline behind ``Comm.wait_all``.

A receive is complete once a message has matched it (and, on a slow link, has arrived); the
message is copied into its buffer in the receiver's thread. A send is complete at once when
it is eager (at most the world's eager limit, and not synchronous), else once a receive has
matched its message.
"""
from __future__ import annotations

import pickle
import time

from minidist.backend import device_of, to_device
from minidist.sim.postoffice import ANY_SOURCE, ANY_TAG, P2P, MessageMismatchError, WaitTimeout


class Status:
    """What a receive found: ``source``, ``tag`` and ``count`` (bytes), read with mpi4py's
    ``Get_source()``, ``Get_tag()``, ``Get_count()`` (bytes, as mpi4py's default ``MPI.BYTE``)."""

    def __init__(self):
        self.source, self.tag, self.count = ANY_SOURCE, ANY_TAG, 0

    def Get_source(self):
        return self.source

    def Get_tag(self):
        return self.tag

    def Get_count(self, datatype=None):
        return self.count


class Request:
    """A pending ``Isend``/``Irecv`` (or lowercase ``isend``/``irecv``), completed by
    ``Wait()``/``Test()`` (``wait()``/``test()`` for pickled objects), as mpi4py's.

    ``comm``: the ``Comm`` that posted it; a receive has ``buf`` (None for a pickled object),
    ``source`` (a world rank, negative for any), ``tag`` and ``context``; a send has
    ``send = (envelope, synchronous)``."""

    def __init__(self, comm, buf=None, source=ANY_SOURCE, tag=ANY_TAG, context=None, send=None):
        context = (comm.context_id, P2P) if context is None else context
        self.comm, self.buf, self.source, self.tag, self.context = comm, buf, source, tag, context
        self.send = send
        self.envelope = send[0] if send else None  # a receive's is set (under the world's lock) when matched
        # an eager send is done at once; in virtual time it too completes (and moves the clock) in Wait
        self.done = bool(send) and not send[1] and comm.world.virtual is None
        self.cancelled = False
        self.result = None

    @property
    def is_send(self):
        return self.send is not None

    def _matched(self):
        env = self.envelope
        if self.is_send:
            return (env.matched or not self.send[1]) and (not env.arrives or env.arrives <= time.perf_counter())
        return env is not None and (not env.arrives or env.arrives <= time.perf_counter())

    def _peers(self):
        """The world ranks this request waits on (None: any rank)."""
        if self.is_send:
            return (self.envelope.record.dest,)
        return None if self.source < 0 else (self.source,)

    def _waiting_for(self):
        if self.is_send:
            r, world = self.envelope.record, self.comm.world
            if world.strict:
                why = "strict mode: every send waits for its receive, as Ssend"
            elif r.nbytes > world.eager_limit:
                why = (f"{r.nbytes} bytes > the eager limit of {world.eager_limit} bytes: MPI may block such a "
                       "send until the receive is posted; use Sendrecv or Isend/Irecv")
            else:
                why = "a synchronous send waits for its receive"
            what = "its pickled send" if r.kind == "object" else "its Send"
            return f"rank {r.dest} to receive {what} (tag {r.tag}; {why})"
        src = "any rank" if self.source < 0 else f"rank {self.source}"
        tag = "any tag" if self.tag < 0 else f"tag {self.tag}"
        what = "a message" if self.context[1] == P2P else "a lowercase collective's message"
        return f"{what} from {src} ({tag})"

    def Wait(self, status=None):
        """Block until the operation completes; for a receive, fill the buffer (and status).
        Returns True (as mpi4py), or the object for a lowercase ``irecv``."""
        if not self.done:
            world = self.comm.world
            with world.cond:
                world.wait_until(self.comm.world_rank, self._matched,
                                 lambda: f"waits for {self._waiting_for()}", self._peers())
            self._complete()
        self._fill(status)
        return self.result if self.buf is None and not self.is_send else True

    def Test(self, status=None):
        """True (and the operation completed) if it can complete now, else False."""
        if not self.done:
            world = self.comm.world
            with world.cond:
                world.raise_if_stopped(self.comm.world_rank)
                if not self._matched():
                    if not world.awaits_timing(self.envelope):
                        world.time_if_others_wait(self.comm.world_rank)  # a poll loop must not spin forever
                        return False
                    world.wait_until(self.comm.world_rank, lambda: not world.awaits_timing(self.envelope),
                                     lambda: f"waits for its message to be timed ({self._waiting_for()})",
                                     self._peers())  # a shared port's message: timed once every rank waits
                    if not self._matched():
                        return False
            self._complete()
        self._fill(status)
        return True

    def wait(self, status=None):
        """mpi4py's lowercase ``wait``: the received object (None for a send)."""
        result = self.Wait(status)
        return None if self.is_send else result

    def test(self, status=None):
        """mpi4py's lowercase ``test``: ``(flag, object)``; the object is None until complete."""
        if not self.Test(status):
            return False, None
        return True, (None if self.is_send else self.result)

    def Cancel(self):
        """Cancel a receive that has not matched a message yet (a later message will not
        land in it); complete it with ``Wait()``, as in MPI. A send, or a receive that has
        matched, is not cancelled (and completes normally)."""
        if self.is_send or self.done:
            return
        world = self.comm.world
        with world.cond:
            if not self._matched() and world.cancel(self, self.comm.world_rank):
                self.done, self.cancelled = True, True

    @classmethod
    def Waitall(cls, requests, statuses=None):
        """Wait for every request in the list (as ``MPI.Request.Waitall``)."""
        for i, req in enumerate(requests):
            req.Wait(None if statuses is None else statuses[i])
        return True

    def _fill(self, status):
        if status is not None and not self.is_send and not self.cancelled:
            r = self.envelope.record
            status.source, status.tag, status.count = self.comm.local_rank(r.source), r.tag, r.nbytes

    def _complete(self):
        """Deliver the matched message into the receive buffer (in the receiver's thread)."""
        env, world, rank = self.envelope, self.comm.world, self.comm.world_rank
        if self.is_send:
            world.sent(env, rank)
            self.done = True
            return
        record = env.record
        expects_object = self.buf is None
        if expects_object != (record.kind == "object"):
            sent = "a pickled object (lowercase send)" if record.kind == "object" else "an array (Send)"
            call = "lowercase recv" if expects_object else "Recv with an array buffer"
            raise MessageMismatchError(f"rank {rank}: {call} matched {sent} from rank {record.source} "
                                       f"(tag {record.tag})")
        if expects_object:
            self.result = pickle.loads(env.payload)
        else:
            buf, payload = self.buf, env.payload
            if buf.dtype != payload.dtype or buf.size != payload.size:
                raise MessageMismatchError(
                    f"rank {rank}: Recv buffer does not fit the message from rank {record.source} "
                    f"(tag {record.tag}): message is {_describe(payload.size, payload.dtype, payload.nbytes)}, "
                    f"buffer is {_describe(buf.size, buf.dtype, buf.nbytes)}")
            if buf.size:
                buf.reshape(-1)[...] = to_device(payload, device_of(buf)).reshape(-1)
        world.received(record, rank, env)
        self.done = True


def _describe(count, dtype, nbytes):
    return f"{count} x {dtype} ({nbytes} bytes)"


def wait_all(comm, requests, timeout=None, expire_on_deadlock=False):
    """``Comm.wait_all``: complete every request of ``comm``'s rank, waiting ``timeout`` seconds
    at most in all (None: only the world's timeout), with deadlock detection (and
    ``expire_on_deadlock``: ``minidist.sim.postoffice``). Returns the results (the object for a
    lowercase ``irecv``, else None); raises WaitTimeout naming what it still waits for."""
    deadline = None if timeout is None else time.perf_counter() + float(timeout)
    world, results = comm.world, []
    for i, req in enumerate(requests):
        if not req.done:
            try:
                with world.cond:
                    world.wait_until(comm.world_rank, req._matched, lambda req=req: f"waits for {req._waiting_for()}",
                                     req._peers(), deadline, expire_on_deadlock)
            except WaitTimeout as timed_out:
                with world.cond:
                    pending = [j for j in range(i, len(requests))
                               if not requests[j].done and not requests[j]._matched()]
                peers = sorted({r for j in pending for r in (requests[j]._peers() or (None,))},
                               key=lambda r: -1 if r is None else r)
                waits = "; ".join(requests[j]._waiting_for() for j in pending)
                raise WaitTimeout(f"rank {comm.rank} waited {timeout:g} s for: {waits}", pending, peers,
                                  timed_out.deadlocked) from None
            req._complete()
        results.append(None if req.is_send else req.result)
    return results

"""The HTTP endpoint of ``minidist serve``: OpenAI's completions API over the continuous-batching scheduler.

Two threads share the work. The web server (Tornado, https://www.tornadoweb.org: an event loop that
holds every open connection at once) parses requests and streams tokens back; one scheduler thread
owns the :class:`~minidist.serving.scheduler.Scheduler` (which is not thread-safe) and runs its
``step()`` while there is work, so the requests of different clients join and leave one running batch
(iteration-level scheduling, Orca: Yu et al., OSDI 2022). vLLM's ``AsyncLLMEngine``
(vllm/engine/async_llm_engine.py) runs its engine loop as a background task beside the web server
and gives each request a queue of outputs; ours is a thread, because a NumPy step holds the CPU and
would stall every connection if it ran on the event loop. Commands (add, cancel) go to the
scheduler thread on one queue, each request's events come back on its own (``call_soon_threadsafe``),
and each token is written to its client as soon as it exists.

Routes:

- ``POST /v1/completions``: OpenAI's legacy completions, the fields and shapes of
  :mod:`minidist.serving.completions` (``prompt``, ``max_tokens``, ``temperature``, ``top_k``, ``seed``,
  ``stream``). The answer is a ``text_completion`` object; with ``"stream": true``, server-sent
  events: one ``data: {...}`` chunk per token, a last chunk carrying ``finish_reason``, then
  ``data: [DONE]``.
- ``GET /health``: ``{"status": "ok", ...}`` with the scheduler's counts (:meth:`SchedulerThread.health`).

A bad request is answered 400 with OpenAI's error shape ``{"error": {"message", "type", "param",
"code"}}`` naming the fix (malformed JSON, a missing or wrong-typed field, characters outside the
model's vocabulary, a prompt plus ``max_tokens`` longer than the model's block size) and the server goes
on. A client that disconnects cancels its request: the scheduler frees its KV blocks at once.

Tensor-parallel serving (``minidist serve --tp N`` under ``mpiexec -n N``): rank 0 runs all of this,
the other ranks run :func:`follow`, which mirrors rank 0's scheduler (:class:`SchedulerThread`).
"""
from __future__ import annotations

import asyncio
import collections
import json
import queue
import threading
import time
import uuid

import tornado.httpserver
import tornado.iostream
import tornado.netutil
import tornado.web

from minidist.collectives import scatter_objects
from minidist.serving.completions import InvalidRequest, completion_object, completion_request, error_object
from minidist.serving.scheduler import Event, Request, Scheduler

__all__ = ["CompletionServer", "SchedulerThread", "follow"]

# How often (seconds) an idle scheduler thread looks whether it was asked to stop (and, tensor-parallel, tells
# the other ranks that it is still there).
IDLE_POLL_S = 0.1
# Tensor-parallel: what rank 0 sends the other ranks instead of commands when the server stops.
CLOSE = "close"


# ---------------------------------------------------------------------------------------
# The scheduler thread
# ---------------------------------------------------------------------------------------


class SchedulerThread:
    """One thread that owns a :class:`Scheduler` and runs its ``step()`` while it has work.

    Other threads only put commands on a queue: :meth:`submit` (a request and a ``deliver``
    callable) and :meth:`cancel`. ``deliver`` is called on this thread with ``("added", id)`` or
    ``("rejected", message)`` first (the scheduler's ValueError), then with each of the request's
    ``Event``\\ s, the last one ``finished``; it must only hand the item over (e.g.
    ``loop.call_soon_threadsafe``). A step that raises ends every running request with an
    ``error: ...`` event, and the thread goes on. :meth:`health` is a snapshot taken after each
    iteration. ``start()`` / ``stop()`` (joins the thread).

    Tensor-parallel (``comm``, the group, this on its rank 0; ``scheduler`` over a
    ``TensorParallelDecoder``): every rank runs the same scheduler on the same requests, and their
    sampled tokens agree by construction (:mod:`minidist.serving.tp_decode`), so only the commands
    need sharing. Each iteration starts with one round (``scatter_objects``' info) carrying the
    commands rank 0 applied, the empty list when idle (every IDLE_POLL_S: the other ranks' waits
    never reach the collectives' deadline); the other ranks run :func:`follow`. ``stop`` ends them.
    """

    def __init__(self, scheduler: Scheduler, comm=None):
        self.scheduler, self.comm = scheduler, comm
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[int, object] = {}  # request id -> deliver, while it runs (this thread only)
        self.finished = collections.Counter()  # finish reasons ("error: ..." counted as "error")
        self.thread = threading.Thread(target=self._run, name="minidist-scheduler", daemon=True)
        self.stopping = threading.Event()
        self._health = self._snapshot()

    def start(self) -> SchedulerThread:
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop after its current step and join the thread."""
        self.stopping.set()
        self.commands.put(("stop",))
        if self.thread.is_alive():
            self.thread.join()

    def submit(self, request: Request, deliver) -> None:
        """Queue ``request``; its id and events reach ``deliver`` (see the class docstring)."""
        self.commands.put(("add", request, deliver))

    def cancel(self, request_id: int) -> None:
        """Queue the cancellation of ``request_id`` (nothing if it has finished already)."""
        self.commands.put(("cancel", request_id))

    def health(self) -> dict:
        """The last snapshot: ``requests_in_flight`` (added, not finished), ``requests_finished``
        (per finish reason) and the scheduler's ``stats()`` (waiting, running, KV blocks free and
        in all, preemptions), where it has them."""
        return self._health

    def _snapshot(self) -> dict:
        stats = self.scheduler.stats() if hasattr(self.scheduler, "stats") else {}
        return {"requests_in_flight": len(self.sinks), "requests_finished": dict(self.finished), **stats}

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                applied = self._take_commands(wait=not self.scheduler.has_work())
                if self.comm is not None:  # the other ranks' schedulers take the same commands (even none: idle)
                    scatter_objects(self.comm, None, info=applied)
                if self.scheduler.has_work():  # the same answer on every rank: they step together
                    try:
                        events = self.scheduler.step()
                    except Exception as error:  # a failed step ends its requests, not the server
                        events = self._fail_all(f"error: {type(error).__name__}: {error}")
                    for event in events:
                        self._deliver(event)
                self._health = self._snapshot()
        finally:
            if self.comm is not None:
                scatter_objects(self.comm, None, info=CLOSE)

    def _take_commands(self, wait: bool) -> list:
        """Apply every queued command; when ``wait``, block for the first (up to IDLE_POLL_S).
        Returns those the scheduler took, as :func:`follow` applies them: ``("add", request)``,
        ``("cancel", id)``."""
        applied = []
        try:
            command = self.commands.get(timeout=IDLE_POLL_S) if wait else self.commands.get_nowait()
        except queue.Empty:
            return applied
        while True:
            if command[0] == "add":
                _, request, deliver = command
                try:
                    request_id = self.scheduler.add(request)
                except ValueError as error:
                    deliver(("rejected", str(error)))
                else:
                    self.sinks[request_id] = deliver
                    applied.append(("add", request))
                    deliver(("added", request_id))
            elif command[0] == "cancel" and command[1] in self.sinks:
                self.scheduler.cancel(command[1])
                applied.append(command)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return applied

    def _deliver(self, event) -> None:
        deliver = self.sinks.get(event.request_id)
        if event.finished:
            self.sinks.pop(event.request_id, None)
            self.finished["error" if str(event.reason).startswith("error") else event.reason] += 1
        if deliver is not None:
            deliver(event)

    def _fail_all(self, reason: str) -> list:
        """Cancel every running request after a failed step; their ``error`` events."""
        events = []
        for request_id in list(self.sinks):
            try:
                self.scheduler.cancel(request_id)
            except Exception:  # the scheduler is broken already; the client hears the reason
                pass
            events.append(Event(request_id, None, True, reason))
        return events



def follow(comm, scheduler: Scheduler) -> int:
    """A tensor-parallel rank other than 0 (``comm``'s rank 0 runs the server's
    :class:`SchedulerThread`): each round, take the commands rank 0 applied, apply them to this
    rank's ``scheduler`` and step it when it has work, as rank 0 does, until rank 0 stops the
    server. Returns the number of steps run (collective; a rank 0 that stops answering ends it
    with CollectiveTimeout after the collectives' deadline)."""
    steps = 0
    while True:
        _, commands = scatter_objects(comm, None)
        if commands == CLOSE:
            return steps
        for command in commands:
            if command[0] == "add":
                scheduler.add(command[1])
            else:
                scheduler.cancel(command[1])
        if scheduler.has_work():
            scheduler.step()
            steps += 1


# ---------------------------------------------------------------------------------------
# The routes
# ---------------------------------------------------------------------------------------


class JSONHandler(tornado.web.RequestHandler):
    """A route of :class:`CompletionServer` (``initialize(server=...)``) whose errors, its own and
    Tornado's (404 for an unknown path, 405 for a wrong method, 500), are OpenAI's JSON."""

    def initialize(self, server: CompletionServer) -> None:
        self.server = server

    def fail(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        self.set_status(status)
        self.finish(error_object(message, type_, param))

    def write_error(self, status_code: int, **kwargs) -> None:
        kind = "server_error" if status_code >= 500 else "invalid_request_error"
        said = {404: f"no route {self.request.method} {self.request.path}: this server answers "
                     "POST /v1/completions and GET /health",
                405: f"{self.request.path} does not take {self.request.method}"}.get(status_code, self._reason)
        self.finish(error_object(said, kind))


class NotFoundHandler(JSONHandler):
    """Every path but the routes: 404 in OpenAI's error shape."""

    def prepare(self) -> None:
        raise tornado.web.HTTPError(404)


class HealthHandler(JSONHandler):
    """``GET /health``: ``{"status": "ok", "model", ...}`` and :meth:`SchedulerThread.health`."""

    def get(self) -> None:
        self.finish({"status": "ok", "model": self.server.model_name, **self.server.scheduler.health()})


class CompletionsHandler(JSONHandler):
    """``POST /v1/completions`` (module docstring): the request goes to the scheduler thread, its
    tokens come back one event at a time and are written as they come (streamed) or gathered."""

    request_id: int | None = None
    running = False  # between the scheduler's "added" and the request's last event
    gone = False  # the client closed the connection

    async def post(self) -> None:
        try:
            request, stream = completion_request(self.request.body, self.server.tokenizer, self.server.block_size)
        except InvalidRequest as error:
            return self.fail(400, str(error), param=error.param)
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.server.scheduler.submit(request, lambda item: loop.call_soon_threadsafe(events.put_nowait, item))
        kind, value = await events.get()
        if kind == "rejected":
            return self.fail(400, value)
        self.request_id, self.running = value, True
        if self.gone:  # it left while the request was queued
            return self.on_connection_close()
        head = (f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.server.model_name)
        if stream:
            await self.stream(events, head)
        else:
            await self.gather(events, head, len(request.prompt_ids))

    async def stream(self, events: asyncio.Queue, head: tuple) -> None:
        """Server-sent events: a chunk per token, the finish reason's chunk, ``data: [DONE]``."""
        self.set_header("Content-Type", "text/event-stream; charset=utf-8")
        self.set_header("Cache-Control", "no-cache")
        try:
            while self.running:
                event = await events.get()
                self.running = not event.finished
                if event.token_id is not None:
                    await self.send(completion_object(*head, self.server.tokenizer.decode([event.token_id]), None))
                if event.finished and event.reason.startswith("error"):
                    await self.send(error_object(event.reason, "server_error"))
                elif event.finished and not self.gone:
                    await self.send(completion_object(*head, "", event.reason))
            await self.send(None)
        except tornado.iostream.StreamClosedError:  # the client left mid-stream
            self.on_connection_close()

    async def send(self, body: dict | None) -> None:
        """One server-sent event, ``data: <json>`` (``data: [DONE]`` for None), flushed now."""
        self.write(f"data: {'[DONE]' if body is None else json.dumps(body)}\n\n")
        await self.flush()

    async def gather(self, events: asyncio.Queue, head: tuple, prompt_tokens: int) -> None:
        """The whole completion as one ``text_completion`` object."""
        tokens = []
        while self.running:
            event = await events.get()
            self.running = not event.finished
            if event.token_id is not None:
                tokens.append(event.token_id)
        if self.gone:
            return
        if event.reason.startswith("error"):
            return self.fail(500, event.reason, "server_error")
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                 "total_tokens": prompt_tokens + len(tokens)}
        self.finish(completion_object(*head, self.server.tokenizer.decode(tokens), event.reason, usage))

    def on_connection_close(self) -> None:
        """The client left: cancel its request (the scheduler frees its KV blocks)."""
        self.gone = True
        if self.running:
            self.server.scheduler.cancel(self.request_id)


# ---------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------


class CompletionServer:
    """``minidist serve``'s server: a GPT and its tokenizer behind ``POST /v1/completions`` and
    ``GET /health`` (module docstring).

    Args:
        model: a GPT (``models.gpt.GPT``) in eval mode; tokenizer: its ``data.CharTokenizer``.
        host, port: where to listen; port 0 picks a free port (read it back from ``.port``).
        model_name: the ``model`` field of the answers (the checkpoint's name).
        max_batch, kv_block_size, num_kv_blocks: the :class:`Scheduler`'s.
        comm: tensor-parallel serving: the group (this is its rank 0; the others run
            :func:`follow`), ``model`` a ``TensorParallelDecoder`` over it. None: one process.

    The socket is bound here (OSError when the port is taken); :meth:`serve_forever` runs the
    event loop and the scheduler thread in the calling thread until :meth:`stop` (from any
    thread) or Ctrl-C (KeyboardInterrupt, after both are stopped). ``ready`` is set once it serves.
    """

    def __init__(self, model, tokenizer, *, host: str = "127.0.0.1", port: int = 8000,
                 model_name: str = "minidist-gpt", max_batch: int = 8, kv_block_size: int = 16,
                 num_kv_blocks: int | None = None, comm=None):
        self.tokenizer, self.model_name, self.block_size = tokenizer, model_name, model.config.block_size
        scheduler = Scheduler(model, kv_block_size=kv_block_size, num_kv_blocks=num_kv_blocks, max_batch=max_batch)
        self.scheduler = SchedulerThread(scheduler, comm)
        self.sockets = tornado.netutil.bind_sockets(port, host)
        self.host, self.port = host, self.sockets[0].getsockname()[1]
        self.ready = threading.Event()
        self._loop = self._stopped = None

    @property
    def url(self) -> str:
        """``http://HOST:PORT``, the address clients use."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def application(self) -> tornado.web.Application:
        """The routes, each handler given this server."""
        routes = [("/v1/completions", CompletionsHandler, {"server": self}),
                  ("/health", HealthHandler, {"server": self})]
        return tornado.web.Application(routes, default_handler_class=NotFoundHandler,
                                       default_handler_args={"server": self})

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` or Ctrl-C; the scheduler thread is stopped and the sockets
        closed either way."""
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop, self._stopped = asyncio.get_running_loop(), asyncio.Event()
        http = tornado.httpserver.HTTPServer(self.application())
        http.add_sockets(self.sockets)
        self.scheduler.start()
        self.ready.set()
        try:
            await self._stopped.wait()
        finally:
            http.stop()
            self.scheduler.stop()

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (thread-safe); it may still be finishing on return."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)

"""The one run of every strategy that trains on a communicator: :func:`train_parallel`, and
:class:`ParallelRun`, what a wing hands it.

Every parallel driver did the same seventeen things in the same order: keep within the
deadline, lay the ranks out, take this rank's part of the global batch, build the workload,
lay the model out over the ranks, build the optimizer, the loader and the lr schedule, the log,
the loss scaler and the step, log the layout, build the checkpointer, :func:`~minidist.train.fit`,
finish (close the checkpoint folder, gather a dense model, save it), gather the figures, free
the groups. What differs between strategies is how the model is laid out and stepped, and what
is reported. So the order is written once, here, and a wing writes only what differs: a
subclass of :class:`ParallelRun` whose constructor is its *parallelize* step (model, mesh,
optimizer) and whose few methods say how to step, what to log, report and save, and its
figures. torchtitan splits its trainer the same way: one ``Trainer`` loop, and per model a
``parallelize_fn`` (``parallelize_llama``: TP, then CP, then FSDP) registered in its
``TrainSpec`` (``torchtitan/train.py``, ``torchtitan/protocols/train_spec.py``).

Why a class and not a function that returns a record: a wing's hooks share the state its
parallelize step made (the mesh, the counting communicators, the meters of its reports), and
a class keeps them in one place a reader can follow top to bottom. The strategies that do not
fit the loop keep their own drivers, beside it: the parameter servers (servers and workers run
different programs) and PipeDream (no flush: a step is not a consistent cut); the one-process
reference, :func:`~minidist.train.train_single`, stays the plainest code of all.
"""
from __future__ import annotations

from minidist import precision
from minidist.fault import Checkpointer
from minidist.train.config import TrainConfig, TrainResult
from minidist.train.loop import checkpoint_parts, collective_deadline, fit, rank_logger


class ParallelRun:
    """A strategy's run on a communicator, as :func:`train_parallel` drives it.

    A wing subclasses it. Its constructor is the wing's *parallelize* step, called within the
    run's deadline: it checks the layout, builds its mesh or groups, this rank's config
    (``per_rank_config``: its part of the global batch), the workload, the model laid out over
    the ranks and the optimizer on this rank's parameters, and calls ``super().__init__`` with
    them. The attributes the loop reads:

    - ``comm``, ``config`` (this rank's), ``work`` (the workload: ``train.workload_for``);
    - ``model``: what the checkpointer saves and loads (the wrapped model, or this rank's stages);
    - ``optimizer`` and ``lr``; ``dp_rank`` and ``dp``: which share of each global batch this
      rank reads (``work.loader(dp_rank, dp, **loader_options)``), and over how many replicas;
    - ``loader_options`` (a pipeline's ``min_batch``), ``reports_everywhere`` (True when
      evaluation is collective, so every rank takes part in :meth:`report`; else rank 0 alone).

    The loop sets ``loader``, ``schedule`` (the lr schedule), ``scaler`` (a
    ``precision.GradScaler``, disabled in fp32) and ``log`` before it calls :meth:`step`. The
    methods a wing writes: :meth:`step` and :meth:`describe` (required), :meth:`report`,
    :meth:`checkpoint_options`, :meth:`finish`, :meth:`figures` and :meth:`free` (defaults
    below)."""

    loader_options: dict = {}
    reports_everywhere = False

    def __init__(self, comm, config: TrainConfig, work, model, optimizer, lr: float, dp_rank: int = 0, dp: int = 1):
        self.comm, self.config, self.work = comm, config, work
        self.model, self.optimizer, self.lr = model, optimizer, lr
        self.dp_rank, self.dp = dp_rank, dp
        self.loader = self.schedule = self.scaler = self.log = None

    def step(self):
        """The step function ``step(x, y) -> float`` the loop trains with (e.g.
        ``train.workload_step`` or ``train.sharded_step``, perhaps in a ``StepBytes``)."""
        raise NotImplementedError(f"{type(self).__name__} must define step()")

    def describe(self) -> str:
        """The run's first log line: its layout, batch and lr."""
        raise NotImplementedError(f"{type(self).__name__} must define describe()")

    def report(self, epoch: int, loss: float, seconds: float) -> dict | None:
        """``fit``'s ``on_epoch_end``: the workload's report of ``self.model`` (rank 0 alone
        unless ``reports_everywhere``), the scaler's state added."""
        return self.work.report(self.model, epoch, loss, seconds, self.log, extra=self.scaler.describe(),
                                world_size=self.dp)

    def checkpoint_options(self) -> dict:
        """The Checkpointer's keyword arguments beyond the common ones (``gathered``, ``layout``,
        ``reshard``, ``per_rank``): none by default."""
        return {}

    def finish(self, checkpointer) -> object:
        """After training: write the final weights (``config.save_model``) and return the dense
        model a ``TrainResult`` carries. Collective where gathering the model is."""
        checkpointer.save_model()
        return self.model

    def figures(self, step) -> dict | None:
        """The run's figures (``key=value`` lines) on rank 0, None elsewhere; ``step`` is what
        :meth:`step` returned. Collective where a figure is gathered from every rank."""
        return {}

    def free(self) -> None:
        """Free the groups the run made (collective); nothing by default."""


def train_parallel(parallelize, comm, config: TrainConfig, dataset, *,
                   checkpointer_class=Checkpointer) -> TrainResult | None:
    """Train ``config`` over ``comm`` the one way every strategy of the loop trains:
    ``parallelize(comm, config, dataset)`` (a :class:`ParallelRun` subclass, the wing's) lays the
    model out, then the loader, the lr schedule, the log (rank 0), the loss scaler, the step, the
    checkpointer (``checkpointer_class``: ``minidist.replay`` passes its own) and
    :func:`~minidist.train.fit`, with every wait of every rank giving up after
    ``config.timeout`` seconds (:func:`~minidist.train.collective_deadline`).

    Returns a TrainResult on rank 0 (the workload's final figures, the history, the run's
    :meth:`ParallelRun.figures` and its dense model) and None on the other ranks. Raises what
    the run raises: ValueError (naming the fix) for a layout its wing refuses,
    NonFiniteLossError, checkpoint_io.CheckpointError, fault.TrainingStopped."""
    with collective_deadline(config.timeout):
        run = parallelize(comm, config, dataset)
        rank, work = comm.Get_rank(), run.work
        run.loader = work.loader(run.dp_rank, run.dp, **run.loader_options)
        run.schedule = work.lr_schedule(run.optimizer, len(run.loader))
        progress = rank == 0 and run.config.progress
        run.log = rank_logger(rank == 0, progress)
        run.scaler = precision.grad_scaler_for(run.config.precision, run.config.loss_scale)
        step = run.step()
        run.log(run.describe())
        checkpointer = checkpointer_class(run.config, run.model, run.optimizer, run.schedule, comm=comm, log=run.log,
                                          extra=checkpoint_parts(work, run.loader, run.scaler),
                                          metadata=work.metadata(), **run.checkpoint_options())
        report = run.report if run.reports_everywhere or rank == 0 else None
        history = fit(step, run.loader, work.epochs, on_epoch_end=report, progress=progress,
                      start=work.begin(checkpointer.resume()), on_step_end=checkpointer, bar_label=work.bar_label)
        dense = run.finish(checkpointer)
        figures = run.figures(step)
        run.free()
    if rank != 0:
        return None
    return TrainResult(**work.final(dense, history), history=history, figures=figures, model=dense)

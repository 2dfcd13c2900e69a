"""Replay one training step from a checkpoint: ``train --checkpoint-dir D --replay-step K``.

A run that diverged at step 40,000, or whose loss jumped there, is hard to debug from its
log: the step is long past. Training here is deterministic (the same seed, flags and number
of ranks give bit-identical weights, see README "Determinism and replay"), and a checkpoint
holds the whole training state (:class:`minidist.fault.Checkpointer`), so the step can be run
again, alone, and looked at:

1. restore the newest valid checkpoint of D taken *before* step K (the one of step s < K holds
   the state after s steps; none: start from the seed, step 0);
2. rerun steps s+1 .. K-1 exactly as training ran them (the same driver, loader, optimizer and
   lr schedule: the strategy's own code runs, given a Checkpointer subclass,
   :class:`ReplayCheckpointer`, that saves nothing);
3. run step K and report, per named parameter, the norm of its gradient, of the weight before
   the step and of the update the optimizer applied (after minus before), plus the step's loss;
4. stop: nothing is trained past K and nothing is written to D.

All of it runs under :class:`minidist.anomaly.detect_anomaly`, so a step that produces a NaN or
an infinity stops at the first op that made one, named with its call site.

The bit-identity of the replayed gradients with those of the uninterrupted run is tested in
``tests/test_replay.py``. This is the "checkpoint, then deterministic replay" debugging of
large runs (e.g. the OPT-175B logbook, Zhang et al. 2022, restarting from a checkpoint before a
loss spike); PyTorch users build it from ``torch.use_deterministic_algorithms`` and a
checkpoint.
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from minidist import backend, strategy
from minidist.anomaly import detect_anomaly
from minidist.checkpoint_io import CheckpointError, CheckpointWarning, list_checkpoints, load_checkpoint
from minidist.fault import Checkpointer
from minidist.p2p import agree


def replayable() -> list[str]:
    """The strategies whose steps a replay reruns (their records say ``replay=True``)."""
    return [record.name for record in strategy.strategies() if record.replay]


class ReplayError(ValueError):
    """The step cannot be replayed (e.g. it lies past the end of the run the flags describe)."""


@dataclasses.dataclass
class ReplayReport:
    """What one replayed step did.

    step: the global step K (from 1). epoch, batch: where it lies (both from 1). start_step: the
    step of the checkpoint restored (0: from the seed). checkpoint: its path, or None. loss: the
    step's loss (under ddp, this rank's batch). grads, before, after: ``{name: float64 NumPy
    array}`` of each named parameter's gradient of step K (under ddp the averaged one), weight
    before and weight after the step. ``rows()`` gives the norms; ``format()`` the table printed.
    """

    step: int
    epoch: int
    batch: int
    start_step: int
    checkpoint: str | None
    loss: float
    grads: dict
    before: dict
    after: dict

    def rows(self) -> list[tuple[str, float, float, float]]:
        """``(name, grad_norm, weight_norm, update_norm)`` per parameter: L2 norms (float64) of
        the gradient, of the weight before the step, and of after minus before."""
        return [(name, float(np.linalg.norm(self.grads[name])), float(np.linalg.norm(self.before[name])),
                 float(np.linalg.norm(self.after[name] - self.before[name]))) for name in self.grads]

    def format(self) -> str:
        """The report as printed by ``train --replay-step``: one header line, one line per parameter."""
        source = f"checkpoint {self.checkpoint} (step {self.start_step})" if self.checkpoint else "the seed (step 0)"
        lines = [f"replay: step {self.step} (epoch {self.epoch}, batch {self.batch}) from {source}",
                 f"loss={self.loss:.6g}",
                 f"{'parameter':<24} {'grad_norm':>12} {'weight_norm':>12} {'update_norm':>12}"]
        lines += [f"{name:<24} {g:12.6g} {w:12.6g} {u:12.6g}" for name, g, w, u in self.rows()]
        return "\n".join(lines)


class _ReplayDone(Exception):
    """Raised from fit's step hook once step K is done, carrying the report out of the driver."""

    def __init__(self, report: ReplayReport):
        super().__init__(f"replayed step {report.step}")
        self.report = report


def _weights(model) -> dict:
    return {name: backend.to_numpy(p.data).astype(np.float64) for name, p in model.named_parameters()}


class ReplayCheckpointer(Checkpointer):
    """The driver's Checkpointer during a replay: resumes from the newest valid checkpoint
    before ``config.replay_step`` (not the newest), saves nothing, and at the end of step K
    raises with the :class:`ReplayReport`. Takes the arguments of :class:`Checkpointer`."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.target = config.replay_step
        self.path, self.start_step, self._before = None, 0, None

    def _pick(self):
        """The newest checkpoint of step < K that verifies, as (path, state); (None, None) if none."""
        for step, path in reversed(list_checkpoints(self.config.checkpoint_dir)):
            if step >= self.target:
                continue
            try:
                return path, load_checkpoint(path)
            except CheckpointError as error:
                warnings.warn(f"{error}; skipping it for the previous checkpoint", CheckpointWarning, stacklevel=2)
        return None, None

    def resume(self) -> dict | None:
        """Restore the checkpoint before step K (rank 0 picks it; every rank loads that file)."""
        path, state = self._pick() if self.rank == 0 else (None, None)
        if self.comm is not None and self.world_size > 1:
            path = agree(self.comm, None, path)[0]
            problem = None
            if path is not None and self.rank != 0:
                try:
                    state = load_checkpoint(path)
                except CheckpointError as error:
                    problem = f"{error} (--checkpoint-dir must be a folder all ranks share)"
            agree(self.comm, problem, None)
        position = None
        if path is not None:
            position = self.load(state, path)
            self.path, self.start_step = path, state["step"]
        self.log(f"replay: restored {path or 'nothing (no checkpoint before the step): from the seed'}, "
                 f"step {self.start_step}; rerunning to step {self.target}")
        if self.start_step == self.target - 1:
            self._snapshot(position)
        return position

    def _snapshot(self, position) -> None:
        """The weights and the loss sum at the end of step K - 1."""
        position = position or {}
        self._before = (_weights(self.model), position.get("loss_total", 0.0))

    def __call__(self, position: dict) -> None:
        """fit's step hook: note the state after step K - 1, report after step K."""
        step = position["global_step"]
        if step == self.target - 1:
            self._snapshot(position)
        elif step == self.target:
            before, total_before = self._before
            # fit sums the losses of an epoch's steps: step K's is the increase over step K - 1
            # (exact when K opens an epoch; else to the last bits of the sum).
            loss = position["loss_total"] - total_before if position["step"] > 1 else position["loss_total"]
            grads = {name: backend.to_numpy(p.grad).astype(np.float64) for name, p in self.model.named_parameters()}
            raise _ReplayDone(ReplayReport(step, position["epoch"] + 1, position["step"], self.start_step, self.path,
                                           float(loss), grads, before, _weights(self.model)))

    def save_model(self) -> None:
        """A replay writes no weights."""


def replay(config, train_fn, comm=None) -> ReplayReport:
    """Replay step ``config.replay_step`` (K >= 1) of the run ``config`` describes, from the
    checkpoints in ``config.checkpoint_dir``, under :class:`~minidist.anomaly.detect_anomaly`
    (see the module docstring).

    config: a :class:`~minidist.train.TrainConfig` of a strategy whose record says ``replay``
    (:func:`replayable`: single, with ``comm`` None, or ddp without --zero, with ``comm`` a
    communicator of the same number of ranks as the run that wrote the checkpoints), the flags
    of that run (checked against the checkpoint's), ``replay_step`` and ``checkpoint_dir`` set.
    train_fn: ``train_fn(run, checkpointer_class=...)`` trains the config ``run`` with the run's
    driver on the run's dataset (over ``comm`` for ddp), e.g. ``lambda run, **kw:
    train.train_single(run, dataset, **kw)``; the command line passes its ``run_driver``
    (``minidist.cli.train``). A replay stops it at step K.

    Returns the :class:`ReplayReport` (on every rank). Raises ValueError for a config that
    cannot be replayed, ReplayError when step K lies past the end of the run (``--epochs``),
    CheckpointError for a checkpoint written with other flags or ranks, AnomalyError naming
    the first op that made a NaN or an infinity, NonFiniteLossError if a loss is non-finite
    without any op's output being so (not expected).
    """
    record = strategy.resolve(config)
    if not record.replay:
        raise ValueError(f"replay supports --strategy {strategy.listed(replayable())}, not {record.label}")
    if config.replay_step is None or config.replay_step < 1:
        raise ValueError(f"replay needs replay_step >= 1, got {config.replay_step!r}")
    if config.checkpoint_dir is None:
        raise ValueError("replay needs checkpoint_dir (--checkpoint-dir DIR, the run's checkpoints)")
    if record.one_process != (comm is None):
        raise ValueError(f"replay: --strategy {config.strategy} runs {'without' if record.one_process else 'with'} a "
                         "communicator")
    run = dataclasses.replace(config, resume=True, save_model=None, stop_after_steps=None)
    with detect_anomaly():
        try:
            train_fn(run, checkpointer_class=ReplayCheckpointer)
        except _ReplayDone as done:
            return done.report
    raise ReplayError(f"--replay-step {config.replay_step} lies past the end of the run: {config.epochs} epochs end "
                      "before it (give the run's --epochs)")

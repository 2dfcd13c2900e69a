"""Training checkpoints: the whole training state of a run, saved every N steps and resumed
(:class:`Checkpointer`); the files themselves (atomic save, checksum, newest valid one) are
:mod:`minidist.checkpoint_io`'s, re-exported here.

A run that dies (a killed rank, a lost node) loses everything since its last checkpoint, so a
checkpoint must hold the *whole* training state (model weights, the optimizer's momentum
buffers, the learning-rate schedule, every random generator, the sampler's epoch and position
within it, the global step): resuming from it must then give weights bit-identical to a run
that was never stopped (Keras' ``BackupAndRestore``, PyTorch's "saving and loading a general
checkpoint" recipe). A job whose ranks hold different parts of the state (parameter servers,
pipeline stages) gathers them into one file (:class:`Checkpointer`, ``gathered=True``).
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from minidist import backend, nn
from minidist.checkpoint_io import (  # noqa: F401 (re-exported: minidist.fault is the public name)
    FORMAT,
    CheckpointError,
    CheckpointWarning,
    checkpoint_path,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    save_training_checkpoint,
)
from minidist.collectives import gather_objects, scatter_objects
from minidist.p2p import agree

# ---------------------------------------------------------------------------------------
# Checkpoints of a run: the whole training state, saved every N steps, resumed mid-epoch
# ---------------------------------------------------------------------------------------

# Steps between checkpoints when --checkpoint-every is not given. A save (two copies of the
# weights, fsync twice) took 1.5 ms on the dev machine and a digits step 0.19 ms: every 100
# steps cost 7.9 %, every 500 about 1.6 % (tests/test_py::test_checkpoint_overhead_per_epoch
# prints it). Young/Daly's interval sqrt(2 * save * MTBF) is far longer for any MTBF over a
# minute; 500 steps (about 12 epochs of digits at batch 32) bounds the work a kill loses.
# Under mpiexec -n 2 on the shared 2-core dev machine (tests/test_fault_mpi.py prints it), in
# two runs, busy then quieter: ddp 22.6 / 1.6 ms a save (79 KiB) against 1.8 / 0.45 ms a step,
# 2.5 % / 0.7 %; a 1F1B pipeline of the default 8-Linear MLP 52.6 / 6.1 ms a save (862 KiB, the
# gather to rank 0 included) against 14.5 / 1.9 ms a step, 0.7 % / 0.6 %.
DEFAULT_CHECKPOINT_EVERY = 500
# The configuration a checkpoint must match to be resumed (--epochs may grow).
_RESUME_FIELDS = ("strategy", "batch_size", "lr", "momentum", "weight_decay", "hidden", "seed", "scale_lr",
                  "warmup_epochs", "dataset", "ps_mode", "num_servers", "schedule", "microbatches", "dp",
                  "stages_per_rank")
KILL_MARKER = ".killed-at-{step}"  # in the checkpoint folder: --kill-at-step fired once there


class TrainingStopped(Exception):
    """Raised by :class:`Checkpointer` after global step ``config.stop_after_steps`` (a run
    stopped on purpose, as if killed there; the tests resume from its checkpoints)."""

    def __init__(self, step: int):
        super().__init__(f"stopped after step {step} (--stop-after-steps); continue with --resume")
        self.step = step


class Checkpointer:
    """Saves and restores the whole training state of a run (:mod:`minidist.fault`).

    The state of a rank: the model's ``state_dict`` (unless ``weights=False``); the
    optimizer's (momentum buffers, lr, step count); the lr schedule's counters; every NumPy
    generator (``bit_generator.state`` of the module default generator of :mod:`minidist.nn`
    and of each layer that owns one, e.g. Dropout); where :func:`fit` is (epoch, batches done
    in it, their loss sum, global step, past epochs' rows); the sampler's epoch and position
    (samples read in the epoch); ``extra`` objects' ``state_dict()`` (e.g. ``{"scaler":
    grad_scaler}``; each needs ``state_dict`` and ``load_state_dict``); the configuration
    (:data:`_RESUME_FIELDS`) and world size, which a resumed run must match. The loaders'
    shuffles are functions of (seed, epoch), so epoch and position restore them exactly.

    Two layouts of a job's state (both one file per checkpoint, written by rank 0):

    - replicated (single, ddp; ``gathered=False``): every rank holds the same state; rank 0
      writes its own, every rank loads that file (so the folder must be shared).
    - gathered (ps, pipeline; ``gathered=True``): each rank holds a different part (a
      server's shard, a pipeline stage). Every rank's :meth:`state` is gathered to rank 0
      (:func:`minidist.collectives.gather_objects`), which writes ``{"step", "config", "ranks": [part of rank
      0, ...]}``; on resume rank 0 reads it and sends each rank its part
      (:func:`minidist.collectives.scatter_objects`), so only rank 0 touches the folder. One file per checkpoint
      makes it atomic for the whole job. Large systems cannot funnel every byte through one
      rank: they write one shard per rank plus a commit marker once all are durable
      (``torch.distributed.checkpoint``; Mohan et al., "CheckFreq", FAST 2021).

    Used as ``fit(..., start=ckpt.resume(), on_step_end=ckpt)``: every
    ``config.checkpoint_every`` global steps a checkpoint ``ckpt-<step>.npz`` is written in
    ``config.checkpoint_dir`` atomically, keeping the last ``keep``. A rank that is not in
    fit (a parameter server) calls :meth:`save` and :meth:`after_step` itself. Raises
    :class:`TrainingStopped` after step ``config.stop_after_steps`` (without saving it: the
    steps since the last checkpoint are redone on resume, as after a kill). With
    ``config.kill_at_step`` K, rank ``config.kill_rank`` SIGKILLs itself at the end of step K,
    once per checkpoint folder (:meth:`after_step`).
    """

    def __init__(self, config, model, optimizer, lr_schedule=None, *, comm=None, keep: int = 3, log=print,
                 extra: dict | None = None, gathered: bool = False, weights: bool = True):
        self.config, self.model, self.optimizer, self.lr_schedule = config, model, optimizer, lr_schedule
        self.comm, self.keep, self.log, self.extra = comm, keep, log, dict(extra or {})
        self.gathered, self.weights = gathered, weights and model is not None
        for name, obj in self.extra.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"Checkpointer: extra[{name!r}] needs state_dict() and load_state_dict()")
        self.rank = comm.Get_rank() if comm is not None else 0
        self.world_size = comm.Get_size() if comm is not None else 1
        self.every = config.checkpoint_every or DEFAULT_CHECKPOINT_EVERY
        self.save_seconds, self.saves = 0.0, 0

    def _generators(self) -> list:
        modules = self.model.modules() if self.model is not None else []
        return [nn.default_generator()] + [m.generator for m in modules
                                    if isinstance(getattr(m, "generator", None), np.random.Generator)]

    def _fingerprint(self) -> dict:
        fields = {name: getattr(self.config, name, None) for name in _RESUME_FIELDS}
        fields["hidden"] = list(fields["hidden"])
        return {**fields, "world_size": self.world_size}

    def due(self, step: int) -> bool:
        """Whether global step ``step`` ends with a checkpoint."""
        return self.config.checkpoint_dir is not None and step % self.every == 0

    def state(self, position: dict | None, step: int | None = None) -> dict:
        """This rank's training state at ``position`` (what :func:`fit` hands ``on_step_end``;
        None on a rank outside fit, which then names the global ``step``)."""
        schedule = self.lr_schedule
        state = {
            "step": position["global_step"] if position is not None else step,
            "rng": [g.bit_generator.state for g in self._generators()],
            "config": self._fingerprint(),
            "lr_schedule": None if schedule is None else {k: v for k, v in vars(schedule).items() if k != "optimizer"},
        }
        if position is not None:
            state["position"] = {**position, "history": list(position["history"])}
            state["sampler"] = {"epoch": position["epoch"], "position": position["step"] * self.config.batch_size}
        if self.weights:
            state["model"] = dict(self.model.state_dict())
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        if self.extra:
            state["extra"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        return state

    def load(self, state: dict, path: str) -> dict | None:
        """Restore ``state`` (read from ``path``) into the model, optimizer, schedule, extra
        objects and generators; returns the position to hand :func:`fit` (None for a rank
        outside fit). Raises CheckpointError naming the file when it was written by a run
        with another configuration, or lacks a part this run has."""
        theirs, mine = state.get("config", {}), self._fingerprint()
        differ = [f"{k}: {theirs.get(k)!r} there, {v!r} here" for k, v in mine.items() if theirs.get(k) != v]
        if differ:
            raise CheckpointError(f"checkpoint {path} was written by another run ({'; '.join(differ)}); resume with "
                                  "the same flags and number of ranks, or use another --checkpoint-dir")
        try:
            if self.weights:
                self.model.load_state_dict(state["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            if (state["lr_schedule"] is None) != (self.lr_schedule is None):
                raise ValueError("the lr schedule (--warmup-epochs) differs")
            for key, value in (state["lr_schedule"] or {}).items():
                setattr(self.lr_schedule, key, value)
            saved_extra = state.get("extra", {})
            if set(saved_extra) != set(self.extra):
                raise ValueError(f"extra state {sorted(saved_extra)} saved, {sorted(self.extra)} in this run")
            for name, obj in self.extra.items():
                obj.load_state_dict(saved_extra[name])
            generators = self._generators()
            if len(generators) != len(state["rng"]):
                raise ValueError(f"{len(state['rng'])} random generators saved, {len(generators)} in the model")
            for generator, saved in zip(generators, state["rng"]):
                generator.bit_generator.state = saved
        except (KeyError, ValueError, TypeError) as error:
            raise CheckpointError(f"checkpoint {path} does not fit this run: {error}") from None
        return state.get("position")

    def resume(self) -> dict | None:
        """Restore the newest valid checkpoint of ``config.checkpoint_dir`` (rank 0 picks it,
        skipping corrupt ones with a warning) and return the position for :func:`fit`; None
        (start from scratch, logged) when ``config.resume`` is off or there is no checkpoint
        yet. Replicated: every rank loads rank 0's choice and the ranks agree on its step.
        Gathered: rank 0 sends each rank its part. Called on every rank. Raises CheckpointError."""
        if not self.config.resume:
            return None
        if self.gathered:
            return self._resume_gathered()
        found = latest_valid_checkpoint(self.config.checkpoint_dir) if self.rank == 0 else None
        path, state, problem = (found[0], found[1], None) if found else (None, None, None)
        if self.comm is not None and self.world_size > 1:
            path = agree(self.comm, None, path)[0]
            if path is not None and self.rank != 0:
                try:
                    state = load_checkpoint(path)
                except CheckpointError as error:
                    problem = str(error)
            def raise_problem(problem, rank, size):
                raise CheckpointError(f"{problem} (on rank {rank} of {size}: every rank reads rank 0's "
                                            "choice, so --checkpoint-dir must be a folder all ranks share)")

            steps = agree(self.comm, problem, None if state is None else state["step"], raise_problem=raise_problem)
            if len(set(steps)) != 1:
                raise CheckpointError(f"the ranks read different steps {steps} from {path}")
        if path is None:
            self.log(f"resume: no checkpoint in {self.config.checkpoint_dir} yet, starting from scratch")
            return None
        return self._restored(state, path)

    def _restored(self, state, path):
        position = self.load(state, path)
        where = (f", epoch {position['epoch'] + 1}, batch {position['step']} of it" if position is not None else "")
        self.log(f"resume: from {path} (step {state['step']}{where})")
        return position

    def _resume_gathered(self):
        problem = parts = path = None
        if self.rank == 0:
            found = latest_valid_checkpoint(self.config.checkpoint_dir)
            if found is not None:
                path, whole = found
                parts = whole.get("ranks")
                if not isinstance(parts, list) or len(parts) != self.world_size:
                    count = len(parts) if isinstance(parts, list) else "no"
                    problem = (f"checkpoint {path} holds {count} ranks' parts, this run has {self.world_size} ranks; "
                               "resume with the same number of ranks and flags, or use another --checkpoint-dir")
        if self.comm is not None and self.world_size > 1:
            part, path = scatter_objects(self.comm, parts, root=0, problem=problem, info=path, error=CheckpointError)
        elif problem is not None:
            raise CheckpointError(problem)
        else:
            part = parts[0] if parts else None
        if part is None:
            self.log(f"resume: no checkpoint in {self.config.checkpoint_dir} yet, starting from scratch")
            return None
        return self._restored(part, path)

    def save(self, step: int, position: dict | None = None) -> None:
        """Write the checkpoint of global step ``step`` now (replicated: rank 0 alone;
        gathered: every rank must call it, rank 0 writes, and every rank raises
        CheckpointError when the file cannot be written)."""
        began = time.perf_counter()
        problem = None
        if self.gathered and self.comm is not None and self.world_size > 1:
            parts = gather_objects(self.comm, self.state(position, step), root=0)
            if self.rank == 0:
                problem = self._write(step, {"step": step, "config": self._fingerprint(), "ranks": parts})
            def raise_problem(found, _rank, _size):
                raise CheckpointError(found)

            agree(self.comm, problem, None, raise_problem=raise_problem)
        elif self.rank == 0:
            state = self.state(position, step)
            if self.gathered:
                state = {"step": step, "config": self._fingerprint(), "ranks": [state]}
            problem = self._write(step, state)
            if problem:
                raise CheckpointError(problem)
        self.save_seconds += time.perf_counter() - began
        self.saves += 1

    def _write(self, step, state) -> str | None:
        try:
            save_training_checkpoint(self.config.checkpoint_dir, step, state, keep=self.keep)
        except OSError as error:  # the previous checkpoints are intact; stop rather than train on unprotected
            return f"cannot write the checkpoint of step {step} in {self.config.checkpoint_dir}: {error}"
        return None

    def after_step(self, step: int, stop: bool = True) -> None:
        """The end of global step ``step``: the hidden test hooks. ``config.kill_at_step``
        (with ``config.kill_rank``, default 0): that rank creates ``KILL_MARKER`` in the
        checkpoint folder and SIGKILLs itself, unless the marker exists (so a relaunch with
        --resume runs past it). ``config.stop_after_steps``: raise :class:`TrainingStopped`
        (unless ``stop`` is False: a rank that others stop, e.g. a parameter server)."""
        kill = getattr(self.config, "kill_at_step", None)
        if kill is not None and step == kill and self.rank == (getattr(self.config, "kill_rank", None) or 0):
            marker = os.path.join(self.config.checkpoint_dir, KILL_MARKER.format(step=step))
            if not os.path.exists(marker):
                os.makedirs(self.config.checkpoint_dir, exist_ok=True)
                with open(marker, "w") as file:
                    file.write(f"rank {self.rank} killed itself at the end of step {step}\n")
                    file.flush()
                    os.fsync(file.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
        if stop and self.config.stop_after_steps is not None and step >= self.config.stop_after_steps:
            raise TrainingStopped(step)

    def __call__(self, position: dict) -> None:
        """fit's ``on_step_end``: save every ``every`` global steps (CheckpointError when the
        file cannot be written), then :meth:`after_step`."""
        step = position["global_step"]
        if self.due(step):
            self.save(step, position)
        self.after_step(step)

    def save_model(self) -> None:
        """Write the final weights to ``config.save_model`` (``.npz`` of the state dict, as
        ``evaluate --checkpoint`` reads) on rank 0; nothing without a path."""
        if self.config.save_model and self.rank == 0:
            np.savez(self.config.save_model, **{k: backend.to_numpy(v) for k, v in self.model.state_dict().items()})

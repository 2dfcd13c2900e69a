"""The one-process driver, ``train --strategy single``: the reference every parallel strategy
must match."""
from __future__ import annotations

from minidist import precision
from minidist.fault import Checkpointer
from minidist.train.batch import per_rank_config, workload_for
from minidist.train.config import TrainConfig, TrainResult
from minidist.train.loop import checkpoint_parts, fit, rank_logger, silent, workload_step

# ---------------------------------------------------------------------------------------
# The one-process driver: the reference every parallel strategy must match
# ---------------------------------------------------------------------------------------


def train_single(config: TrainConfig, dataset, *, report: bool = True,
                 checkpointer_class=Checkpointer) -> TrainResult:
    """``train --strategy single``: one process, one model, the reference every parallel
    strategy must match, for either workload (:func:`workload_for`: ``config.model``).

    The MLP: SGD with ``config.lr`` (warmed up over ``config.warmup_epochs``), batches of
    ``config.batch_size`` reshuffled each epoch from ``config.seed``; with ``report`` the model
    is scored on the training and test sets after each epoch and one line printed. The GPT:
    AdamW, warm-up and cosine, ``config.steps`` steps of random windows, train and val loss
    every ``config.eval_every`` steps, a generated sample at the end. Without ``report``
    nothing is printed and only the final figure (test accuracy, val loss) is measured.
    Checkpoints, resume and the final weights' file: :class:`Checkpointer` (or
    ``checkpointer_class``, a subclass: ``minidist.replay`` passes its own). Raises
    NonFiniteLossError when the loss becomes NaN or infinite, checkpoint_io.CheckpointError for
    a checkpoint that cannot be resumed, TrainingStopped after ``config.stop_after_steps``."""
    config = per_rank_config(config, 1)
    work = workload_for(config, dataset)
    model = work.model()
    optimizer = work.optimizer(model.parameters(), config.lr)
    loader = work.loader()
    schedule = work.lr_schedule(optimizer, len(loader))
    scaler = precision.grad_scaler_for(config.precision, config.loss_scale)
    step_fn = workload_step(work, model, optimizer, schedule, scaler)
    log = rank_logger(True, config.progress)
    checkpointer = checkpointer_class(config, model, optimizer, schedule, log=log if report else silent,
                                      extra=checkpoint_parts(work, loader, scaler), metadata=work.metadata())

    if report:  # the first line, as every parallel run's (a GPT's first evaluation is eval_every steps away)
        warmup = getattr(schedule, "warmup_steps", 0)
        ramp = f", warm-up {warmup} step{'s' * (warmup != 1)}" if warmup else ""
        log(f"single: 1 process, batch {config.batch_size}, lr {config.lr:g}{ramp}")

    def on_epoch_end(epoch, loss, seconds):
        return work.report(model, epoch, loss, seconds, log, extra=scaler.describe())

    history = fit(step_fn, loader, work.epochs, on_epoch_end=on_epoch_end if report else None,
                  progress=config.progress and report, start=work.begin(checkpointer.resume()),
                  on_step_end=checkpointer, bar_label=work.bar_label)
    checkpointer.save_model()
    figures = {"ranks": 1, "bytes_communicated": 0, **precision.figures(config.precision, scaler)}
    return TrainResult(**work.final(model, history), history=history, figures=figures, model=model)

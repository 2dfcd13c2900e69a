"""The one-process strategy: ``train --strategy single``, the reference every parallel run must match.
"""
from __future__ import annotations

from tqdm import tqdm

from minidist import data, optim, precision
from minidist.fault import Checkpointer
from minidist.train import (
    TrainConfig,
    TrainResult,
    _quiet,
    _warmup,
    accuracy,
    build_model,
    fit,
    report_epoch,
    supervised_step,
)


def train_single(config: TrainConfig, dataset: data.Dataset, *, report: bool = True,
                 checkpointer_class=Checkpointer) -> TrainResult:
    """One process, one model: the reference every parallel strategy must match.

    SGD with ``config.lr`` (warmed up over ``config.warmup_epochs``), batches of
    ``config.batch_size`` reshuffled each epoch from ``config.seed``. With ``report`` the
    model is scored on the training and test sets after each epoch and one line printed;
    without, nothing is printed and only the final test accuracy is measured. Checkpoints,
    resume and the final weights' file: :class:`Checkpointer` (or ``checkpointer_class``, a subclass:
    ``minidist.replay`` passes its own). Raises NonFiniteLossError when
    the loss becomes NaN or infinite, fault.CheckpointError for a checkpoint that cannot be
    resumed, TrainingStopped after ``config.stop_after_steps``."""
    model = build_model(config, dataset)
    optimizer = optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                          weight_decay=config.weight_decay)
    loader = data.DataLoader(dataset.X_train, dataset.y_train, batch_size=config.batch_size, shuffle=True,
                             seed=config.seed)
    warmup = _warmup(optimizer, config, len(loader))
    scaler = precision.grad_scaler_for(config.precision, config.loss_scale)
    step_fn = supervised_step(model, optimizer, device=config.device, lr_schedule=warmup, precision=config.precision,
                              scaler=scaler if scaler.is_enabled() else None)
    log = tqdm.write if config.progress else print
    checkpointer = checkpointer_class(config, model, optimizer, warmup, log=log if report else _quiet,
                                extra={"scaler": scaler} if scaler.is_enabled() else None)

    def on_epoch_end(epoch, loss, seconds):
        return report_epoch(model, dataset, config, epoch, loss, seconds, log, extra=scaler.describe())

    history = fit(step_fn, loader, config.epochs, on_epoch_end=on_epoch_end if report else None,
                  progress=config.progress and report, start=checkpointer.resume(), on_step_end=checkpointer)
    checkpointer.save_model()
    test_accuracy = (history[-1]["test_accuracy"] if report and history
                     else accuracy(model, dataset.X_test, dataset.y_test, device=config.device))
    figures = {"ranks": 1, "bytes_communicated": 0, **precision.figures(config.precision, scaler)}
    return TrainResult(test_accuracy, history, figures, model)

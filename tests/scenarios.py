"""Test bodies that several test files share (issue 30: written once)."""
from __future__ import annotations

import dataclasses

import pytest

from minidist import backend, cli, sim, train
from minidist.fault import TrainingStopped


def assert_usage_error(args: list[str], message: str, capsys, monkeypatch, why: str = "a bad flag") -> None:
    """``python -m minidist train ARGS`` (in process) exits 2 with ``message`` on stderr and no
    traceback, and never starts training (loading the data set fails the test)."""
    monkeypatch.setattr(train, "load_dataset", lambda config: pytest.fail(f"training started despite {why}"))
    assert cli.main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def on_sim(driver, dataset, ranks: int | None = None, world=None):
    """``train_fn(config)`` for :func:`stop_and_resume`: ``driver(comm, config, dataset)`` (a
    parallel driver) on the simulator's ``ranks`` ranks, or on ``world`` (a ``sim.World``, e.g.
    one with a two-tier topology); returns the first rank's result that is not None (a parameter
    server returns None). A rank's exception is re-raised (``sim.World.run``)."""
    def train_fn(config):
        job = (lambda fn: world.run(fn)) if world is not None else (lambda fn: sim.run(fn, ranks))
        return next(r for r in job(lambda comm: driver(comm, config, dataset)) if r is not None)

    return train_fn


def stop_and_resume(train_fn, config, stop_after: int, between=None):
    """The stop / resume scenario every strategy's checkpoints pass (issue 30: written once, not
    once per test file): ``train_fn(config)`` trains ``config`` (every rank) and returns one
    result. The run is trained once without checkpoints, once with ``config.checkpoint_dir``
    stopped after global step ``stop_after`` (``fault.TrainingStopped`` expected, as if killed
    there), ``between()`` (optional) checks what the stopped run left, then the run is resumed
    from its newest checkpoint. Returns (whole, resumed) for :func:`assert_same_weights` and
    the refusals each strategy owes."""
    whole = train_fn(dataclasses.replace(config, checkpoint_dir=None))
    with pytest.raises(TrainingStopped):
        train_fn(dataclasses.replace(config, stop_after_steps=stop_after))
    if between is not None:
        between()
    return whole, train_fn(dataclasses.replace(config, resume=True))


def assert_same_weights(whole, resumed) -> None:
    """Every weight of ``resumed``'s model equals ``whole``'s to the bit (TrainResults)."""
    state = resumed.model.state_dict()
    assert whole.model.state_dict().keys() == state.keys()
    for key, value in whole.model.state_dict().items():
        assert backend.to_numpy(value).tobytes() == backend.to_numpy(state[key]).tobytes(), key

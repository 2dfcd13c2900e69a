"""Bit-identical resume with the error-feedback comm hooks (int8, top-k).

Their residuals (what compression dropped, added to the next step's gradient) differ per rank
and are part of the training state: a run stopped and resumed, or a replayed step, must see
the residuals the uninterrupted run had. The oracle is the uninterrupted run, on the simulator
(two ranks, in-process); without the residuals in the checkpoint the weights differ by up to
0.05 after one epoch."""
import dataclasses

import numpy as np
import pytest
from scenarios import assert_same_weights, on_sim, stop_and_resume

from minidist import data, fault, sim, train
from minidist.checkpoint_io import list_checkpoints, load_checkpoint
from minidist.parallel.data_parallel.comm_hooks import ErrorFeedbackState, TopKState
from minidist.parallel.data_parallel.train import train_ddp
from minidist.replay import replay


def ddp_config(directory, hook, **more):
    fields = dict(strategy="ddp", epochs=1, hidden=(16,), progress=False, timeout=60, checkpoint_dir=str(directory),
                  checkpoint_every=6, comm_hook=hook, topk_ratio=0.05)
    return train.TrainConfig(**{**fields, **more})


@pytest.mark.parametrize("hook", ["int8", "topk"])
def test_ddp_with_an_error_feedback_hook_stopped_and_resumed_is_bit_identical(tmp_path, hook):
    dataset = data.load_digits(seed=0)

    def saved():  # each rank's own residuals in the checkpoint
        assert [s for s, _ in list_checkpoints(tmp_path)] == [6, 12]
        residuals = load_checkpoint(list_checkpoints(tmp_path)[-1][1])["per_rank"]["comm_hook"]
        assert len(residuals) == 2 and residuals[0]["residuals"] and residuals[1]["residuals"]
        assert any(not np.array_equal(a, b) for a, b in zip(residuals[0]["residuals"].values(),
                                                             residuals[1]["residuals"].values()))

    assert_same_weights(*stop_and_resume(on_sim(train_ddp, dataset, 2), ddp_config(tmp_path, hook), 16, saved))


def test_a_replayed_int8_step_has_the_runs_gradient_bit_for_bit(tmp_path):
    config = ddp_config(tmp_path, "int8", checkpoint_every=5)
    dataset = data.load_digits(seed=0)
    store = {}

    class Capture(fault.Checkpointer):
        def __call__(self, position):
            if position["global_step"] == 13:
                store[self.rank] = {n: p.grad.copy() for n, p in self.model.named_parameters()}
            return super().__call__(position)

    sim.run(lambda comm: train_ddp(comm, config, dataset, checkpointer_class=Capture), 2)
    reports = sim.run(lambda comm: replay(dataclasses.replace(config, replay_step=13),
                                          lambda run, **kw: train_ddp(comm, run, dataset, **kw), comm), 2)
    for rank, report in enumerate(reports):
        assert report.start_step == 10
        for name, grad in store[rank].items():
            assert report.grads[name].tobytes() == grad.astype(np.float64).tobytes(), name


@pytest.mark.parametrize("state", [ErrorFeedbackState(), ErrorFeedbackState(error_feedback=False), TopKState(0.25)])
def test_hook_states_round_trip_through_their_state_dict(state):
    state.residuals = {0: np.arange(5, dtype=np.float32), 3: np.ones(2, dtype=np.float32)}
    copy = type(state)() if not isinstance(state, TopKState) else TopKState(0.25)
    copy.error_feedback = state.error_feedback
    copy.load_state_dict(state.state_dict())
    assert sorted(copy.residuals) == [0, 3]
    assert all(np.array_equal(copy.residuals[k], v) for k, v in state.residuals.items())
    with pytest.raises(ValueError, match="error_feedback"):
        flipped = dict(state.state_dict(), error_feedback=not state.error_feedback)
        copy.load_state_dict(flipped)
    with pytest.raises(ValueError, match="residuals"):
        copy.load_state_dict({k: v for k, v in state.state_dict().items() if k != "residuals"})

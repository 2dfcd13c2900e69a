"""tensor.queue_callback: a callback queued from a hook runs once, after every hook of the
backward pass (the end of backward, where DDP waits for its buckets)."""
import numpy as np
import pytest

from minidist import nn
from minidist.recompute import checkpoint_sequential
from minidist.tensor import Tensor, queue_callback


def test_callback_runs_after_every_hook_once():
    model = nn.mlp([3, 4, 2], rng=0, dtype="float64")
    events = []

    def hook(p):
        events.append("hook")
        if events.count("hook") == 1:
            queue_callback(lambda: events.append("end"))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    model(Tensor(np.ones((2, 3)))).sum().backward()
    assert events == ["hook"] * 4 + ["end"]
    events.clear()
    model(Tensor(np.ones((2, 3)))).sum().backward()  # a fresh queue each backward
    assert events == ["hook"] * 4 + ["end"]


def test_outside_backward_is_an_error():
    with pytest.raises(RuntimeError, match="during a backward pass"):
        queue_callback(lambda: None)


def test_nested_backward_runs_callbacks_at_the_outer_end():
    """A checkpointed segment re-runs forward and backward inside backward; a callback
    queued in there (layer 2's hook) waits for the outer backward's end, after layers 1 and 0."""
    layers = [nn.Linear(3, 3, rng=i, dtype="float64") for i in range(4)]
    events = []
    for i, layer in enumerate(layers):
        layer.weight.register_post_accumulate_grad_hook(
            lambda p, i=i: (events.append(i), queue_callback(lambda: events.append("end")) if i == 2 else None))
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    checkpoint_sequential(layers, 4, x).sum().backward()  # layers 0..2 are recomputed inside backward
    assert sorted(e for e in events if e != "end") == [0, 1, 2, 3] and events[-1] == "end" and events.count("end") == 1

"""split_model: contiguous stages by layer count (numpy.array_split's sizes), by parameter count
(against a brute-force search over every cut, and torchgpipe's blockpartition test cases), or by
an explicit list; the stages chained reproduce the model exactly."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist import nn
from minidist.parallel.pipeline.stage import _min_max_partition, split_model
from minidist.tensor import Tensor


def layer_counts(stages):
    return [len(s) for s in stages]


def test_by_layer_count_first_stages_take_the_remainder():
    model = nn.mlp([8, 16, 16, 16, 4], rng=0)  # Linear ReLU Linear ReLU Linear ReLU Linear
    assert len(model) == 7
    for p, expected in [(1, [7]), (2, [4, 3]), (3, [3, 2, 2]), (4, [2, 2, 2, 1]), (7, [1] * 7)]:
        stages = split_model(model, p)
        assert layer_counts(stages) == expected
        assert layer_counts(stages) == [len(c) for c in np.array_split(np.arange(7), p)]
        assert layer_counts(split_model(model, p, balance="layers")) == expected
        # the same layer objects, in order: training a stage trains the model
        assert [layer for s in stages for layer in s] == list(model)


def test_stages_chained_equal_the_model():
    model = nn.mlp([5, 7, 6, 3], rng=1, dtype="float64")
    x = Tensor(np.random.default_rng(2).standard_normal((4, 5)))
    for balance in (None, "parameters", [1, 1, 3]):
        out = x
        for stage in split_model(model, 3, balance=balance):
            out = stage(out)
        np.testing.assert_array_equal(out.data, model(x).data)
    first = split_model(model, 2)[1]
    assert list(first.state_dict()) == ["1.weight", "1.bias"]  # layers renumbered per stage, as torch slices


def test_by_parameter_count_cuts_where_the_weights_are():
    # parameters per layer: 4*64+64 = 320, 0, 64*64+64 = 4160, 0, 64*4+4 = 260
    model = nn.mlp([4, 64, 64, 4], rng=0)
    assert layer_counts(split_model(model, 2)) == [3, 2]  # by layers: 4480 | 260
    by_params = split_model(model, 2, balance="parameters")
    assert layer_counts(by_params) == [2, 3]  # 320 | 4420: the largest stage as small as it can be
    assert [sum(p.data.size for p in s.parameters()) for s in by_params] == [320, 4420]
    # an activation stays with the layer before it
    assert isinstance(by_params[0][1], nn.ReLU)


@pytest.mark.parametrize("weights, p, expected", [
    ([1, 2, 3, 4, 5, 6], 2, [[1, 2, 3, 4], [5, 6]]),  # torchgpipe's blockpartition tests
    ([0, 0], 2, [[0], [0]]),
    ([5, 0, 0, 1], 2, [[5, 0, 0], [1]]),  # ties: the earlier stage takes the zeros
    ([1, 1, 1, 1, 1], 5, [[1]] * 5),
    ([9, 1, 1, 1], 3, [[9], [1, 1], [1]]),
])
def test_min_max_partition_cases(weights, p, expected):
    assert [weights[a:b] for a, b in _min_max_partition(weights, p)] == expected


@settings(max_examples=150, deadline=None)
@given(weights=st.lists(st.integers(0, 50), min_size=1, max_size=9), data=st.data())
def test_min_max_partition_is_optimal(weights, data):
    """Against every possible cut: contiguous, non-empty, covering, and the largest stage as
    small as any cut allows."""
    p = data.draw(st.integers(1, len(weights)))
    bounds = _min_max_partition(weights, p)
    assert len(bounds) == p and bounds[0][0] == 0 and bounds[-1][1] == len(weights)
    assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    best = min(max(sum(weights[a:b]) for a, b in zip((0, *cuts), (*cuts, len(weights))))
               for cuts in itertools.combinations(range(1, len(weights)), p - 1))
    assert max(sum(weights[a:b]) for a, b in bounds) == best


def test_explicit_balance():
    model = nn.mlp([3, 4, 4, 2], rng=0)  # 5 layers
    assert layer_counts(split_model(model, 3, balance=[1, 3, 1])) == [1, 3, 1]
    assert layer_counts(split_model(model, 2, balance=(4, 1))) == [4, 1]
    for bad in ([1, 3], [1, 3, 2], [0, 4, 1], [1, 3, True], "memory", 3):
        with pytest.raises(ValueError, match="balance"):
            split_model(model, 3, balance=bad)


def test_bad_input_names_the_fix():
    model = nn.mlp([3, 4, 2], rng=0)  # 3 layers
    with pytest.raises(ValueError, match="4 stages but the model has only 3 layers; use at most 3"):
        split_model(model, 4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_stages must be an integer >= 1"):
            split_model(model, bad)
    with pytest.raises(TypeError, match="nn.Sequential"):
        split_model(list(model), 2)
    with pytest.raises(TypeError, match="nn.Sequential"):
        split_model(nn.Linear(2, 2), 1)

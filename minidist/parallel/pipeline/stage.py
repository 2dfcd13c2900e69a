"""Cutting a model into pipeline stages: contiguous runs of an ``nn.Sequential``'s layers.

A pipeline needs the model as a chain, stage s feeding stage s + 1, so a stage is a
contiguous run of layers and the only choice is where to cut. Two ways to choose:

- by layer count (``balance="layers"``, the default): n layers over p stages as
  ``numpy.array_split`` cuts them, the first n % p stages one layer longer;
- by parameter count (``balance="parameters"``): the cut that makes the largest stage's
  parameter count as small as possible (parameters stand in for memory and, for dense
  layers, for compute). This is the linear-partition problem (Skiena, "The Algorithm Design
  Manual", 2nd ed., sec. 8.5); torchgpipe (Kim et al., "torchgpipe: On-the-fly Pipeline
  Parallelism for Training Giant Models", 2020) cuts by measured memory instead. A
  dynamic program finds the smallest possible maximum B in O(n^2 p); then, from the first
  stage on, each stage takes as many layers as fit under B while leaving one for every later
  stage, so ties go to the earlier stages and a layer without parameters (an activation)
  stays with the layer before it.

A list of p layer counts (``balance=[3, 2, 2]``, torchgpipe's form) gives the cut directly.

A stage's weight versions (:class:`WeightStash`). A pipeline that updates its weights
while micro-batches are still in flight (PipeDream, Narayanan et al., SOSP 2019) must run
the backward of micro-batch i on the weights its forward used, or the gradient is of no
function at all: forward with one version, backward with another. The stash keeps, next to
the live parameters (always the latest version), a queue of older versions, oldest first:
a version is pushed just before an update would overwrite it, if a micro-batch in flight
(or a forward still to come) needs it, and popped from the front once nobody does. To run a
pass on version u the stash copies u into the parameters in place (the graph saved
references to those very arrays, so the backward reads what is there when it runs) and
copies the latest back afterwards.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager

from minidist import nn
from minidist.collectives import chunk_bounds


def _parameter_count(layer) -> int:
    return sum(int(p.data.size) for p in layer.parameters())


def _min_max_partition(weights: list[int], num_stages: int) -> list[tuple[int, int]]:
    """(start, stop) of ``num_stages`` non-empty contiguous blocks of ``weights`` whose largest
    sum is as small as possible; among those, earlier blocks take as much as they can."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][i]: the smallest largest-block sum of the first i weights cut into k blocks
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            best[k][i] = min(max(best[k - 1][j], prefix[i] - prefix[j]) for j in range(k - 1, i))
    limit = best[num_stages][n]
    bounds, start = [], 0
    for s in range(num_stages):
        later = num_stages - s - 1
        stop = start + 1
        while stop < n - later and prefix[stop + 1] - prefix[start] <= limit:
            stop += 1
        bounds.append((start, stop))
        start = stop
    assert start == n, "greedy cut under the optimal limit must cover every layer"
    return bounds


def split_model(sequential, num_stages: int, balance=None) -> list:
    """Cut ``sequential`` (an ``nn.Sequential`` of n layers) into ``num_stages`` contiguous stages.

    balance: ``None`` or ``"layers"`` (the first n % p stages take one layer more),
        ``"parameters"`` (minimise the largest stage's parameter count; see the module
        docstring), or a list of ``num_stages`` layer counts, each >= 1, summing to n.
    Returns a list of ``num_stages`` ``nn.Sequential``, stage s holding the next run of the
    same layer objects (no copy: training a stage trains the model). Each stage names its
    layers "0", "1", ... afresh, as slicing a torch ``nn.Sequential`` does.
    Raises TypeError when ``sequential`` is not an ``nn.Sequential``; ValueError when
    ``num_stages`` < 1 or exceeds n (more stages than layers), or ``balance`` is not one of
    the above.
    """
    if not isinstance(sequential, nn.Sequential):
        raise TypeError(f"split_model: expected an nn.Sequential, got {type(sequential).__name__}; "
                        f"wrap the layers in nn.Sequential(...) first")
    n = len(sequential)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"split_model: num_stages must be an integer >= 1, got {num_stages!r}")
    if num_stages > n:
        raise ValueError(f"split_model: {num_stages} stages but the model has only {n} layers; "
                         f"use at most {n} stages (a stage holds at least one layer)")
    if balance is None or balance == "layers":
        bounds = chunk_bounds(n, num_stages)
    elif balance == "parameters":
        bounds = _min_max_partition([_parameter_count(layer) for layer in sequential], num_stages)
    elif isinstance(balance, (list, tuple)):
        counts = list(balance)
        if (len(counts) != num_stages or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts)
                or sum(counts) != n):
            raise ValueError(f"split_model: balance={balance!r} must list {num_stages} layer counts, each >= 1, "
                             f"summing to the model's {n} layers")
        bounds, start = [], 0
        for c in counts:
            bounds.append((start, start + c))
            start += c
    else:
        raise ValueError(f"split_model: balance must be None, 'layers', 'parameters' or a list of "
                         f"{num_stages} layer counts; got {balance!r}")
    return [sequential[start:stop] for start, stop in bounds]


class WeightStash:
    """The weight versions of one stage: the live parameters (the latest version) and a
    queue of older versions still needed (module docstring; PipeDream's weight stashing,
    Narayanan et al., SOSP 2019, sec. 3.3).

    Args:
        params: the stage's parameters (Tensors, updated in place by the optimizer).

    Versions are counted in updates: the parameters start as version 0 and each
    :meth:`update` makes the next. ``version`` is the latest; ``versions_held`` counts the
    latest plus the stashed copies, ``stashed_bytes`` the bytes of the copies (the live
    parameters not counted). Raises ValueError for an empty parameter list; KeyError,
    naming the versions held, when a pass asks for a version that was dropped.
    """

    def __init__(self, params):
        self.params = list(params)
        if not self.params:
            raise ValueError("WeightStash: the stage has no parameters; give it at least one layer with weights")
        self.version = 0
        self.queue = deque()  # (version, [copies of the parameters' arrays]), oldest first
        self.peak_versions = 1
        self.peak_stashed_bytes = 0

    @property
    def versions_held(self) -> int:
        """The latest version plus the stashed ones."""
        return 1 + len(self.queue)

    @property
    def stashed_bytes(self) -> int:
        """Bytes of the stashed copies (the live parameters excluded)."""
        return sum(a.nbytes for _, arrays in self.queue for a in arrays)

    def versions(self) -> list[int]:
        """Every version held, oldest first (the last is the latest, the live one)."""
        return [v for v, _ in self.queue] + [self.version]

    def update(self, optimizer_step, keep: bool) -> None:
        """Apply one update (``optimizer_step()``, which changes the parameters in place)
        and count the new version; with ``keep`` the version it overwrites is pushed first."""
        if keep:
            self.queue.append((self.version, [p.data.copy() for p in self.params]))
            self.peak_versions = max(self.peak_versions, self.versions_held)
            self.peak_stashed_bytes = max(self.peak_stashed_bytes, self.stashed_bytes)
        optimizer_step()
        self.version += 1

    def drop_older_than(self, floor: int) -> None:
        """Pop from the front every stashed version below ``floor`` (nobody needs it)."""
        while self.queue and self.queue[0][0] < floor:
            self.queue.popleft()

    @contextmanager
    def use(self, version: int):
        """Run the body with the parameters holding ``version`` (copied in place), then the
        latest back. The latest itself costs nothing."""
        if version == self.version:
            yield
            return
        arrays = next((a for v, a in self.queue if v == version), None)
        if arrays is None:
            raise KeyError(f"WeightStash: version {version} is not held (held: {self.versions()})")
        latest = [p.data.copy() for p in self.params]
        for p, a in zip(self.params, arrays):
            p.data[...] = a
        try:
            yield
        finally:
            for p, a in zip(self.params, latest):
                p.data[...] = a

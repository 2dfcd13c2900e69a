"""The GPT as a chain of layers, for pipeline parallelism: embeddings, blocks, head.

A pipeline cuts a model into contiguous stages of an ``nn.Sequential``
(``parallel.pipeline.stage.split_model``), so the GPT (:mod:`minidist.models.gpt`) is laid out
as one: :class:`Embeddings` (token ids (B, T) -> wte + wpe, dropout: (B, T, C)), the n_layer
``Block`` modules, and :class:`Head` (``ln_f`` then ``lm_head``: (B, T, C) -> logits
(B, T, V)). The layers are the GPT's own modules (no copy: training the chain trains the
GPT, and the GPT's ``state_dict`` and ``generate`` see the result), so the chain computes
exactly ``GPT.forward``'s logits.

One parameter sits at both ends: ``lm_head.weight`` *is* ``transformer.wte.weight`` (weight
tying). When the first and the last stage live on different ranks each holds its own copy,
which must stay equal: after the backward pass the two copies' gradients are summed between
those two ranks, so both apply the gradient a single process computes for the one tied
weight (its embedding part plus its output-layer part). This is Megatron-LM's embedding group
(Shoeybi et al. 2019; Narayanan et al., SC 2021): ``parallel.pipeline.step.PipelineStep``
does the exchange; :func:`tied_parameters` finds what to exchange.
"""
from __future__ import annotations

from minidist import backend, nn
from minidist.models.gpt import GPT
from minidist.tensor import Tensor


class Embeddings(nn.Module):
    """The GPT's input layer: token ids (B, T) (an integer array or Tensor) -> token plus
    position embeddings, then dropout: (B, T, C). Holds the GPT's ``wte``, ``wpe`` and ``drop``.
    Raises ValueError for T > block_size or an id outside [0, vocab_size), as ``GPT.forward``."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.transformer.wte, gpt.transformer.wpe, gpt.transformer.drop
        self.vocab_size, self.block_size = gpt.config.vocab_size, gpt.config.block_size

    def forward(self, idx):
        ids = idx.data if isinstance(idx, Tensor) else idx
        t = ids.shape[1]
        if t > self.block_size:
            raise ValueError(f"Embeddings: a sequence of length {t} is longer than block_size = {self.block_size}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"Embeddings: token ids must be in [0, vocab_size = {self.vocab_size}); got values "
                             f"from {int(ids.min())} to {int(ids.max())}")
        xp = backend.get_array_module(ids)
        return self.drop(self.wte(ids) + self.wpe(xp.arange(t)))


class Head(nn.Module):
    """The GPT's output layer: (B, T, C) -> ``lm_head(ln_f(x))``, logits (B, T, V); holds the
    GPT's ``ln_f`` and ``lm_head`` (whose weight is the token embedding's)."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.ln_f, self.lm_head = gpt.transformer.ln_f, gpt.lm_head

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


def gpt_sequential(gpt: GPT) -> nn.Sequential:
    """``nn.Sequential(Embeddings, block 0, ..., block n_layer - 1, Head)`` over ``gpt``'s own
    modules: its output on token ids is ``gpt(idx)[0]``, the logits. Raises TypeError when
    ``gpt`` is not a GPT."""
    if not isinstance(gpt, GPT):
        raise TypeError(f"gpt_sequential: expected a GPT, got {type(gpt).__name__}")
    return nn.Sequential(Embeddings(gpt), *gpt.transformer.h, Head(gpt))


def block_balance(n_layer: int, num_stages: int) -> list[int]:
    """The layer counts of ``num_stages`` stages of :func:`gpt_sequential`'s n_layer + 2 layers:
    whole blocks spread as evenly as ``numpy.array_split`` spreads them (the first n_layer %
    num_stages stages one block more), the embeddings added to the first stage and the head to
    the last. Raises ValueError when there are fewer blocks than stages (a stage holds at least
    one block)."""
    if not 1 <= num_stages <= n_layer:
        raise ValueError(f"{num_stages} pipeline stages need at least as many GPT blocks, got n_layer = {n_layer}; "
                         f"give --n-layer {num_stages} or more, or use fewer stages")
    counts = [n_layer // num_stages + (s < n_layer % num_stages) for s in range(num_stages)]
    counts[0] += 1
    counts[-1] += 1
    return counts


def tied_parameters(first, last) -> list:
    """The Parameters held by both modules ``first`` and ``last`` (the first and last stage of a
    :func:`gpt_sequential` cut: the tied token embedding), in ``first``'s order; empty when
    they share none (an MLP's stages)."""
    mine = {id(p) for p in last.parameters()}
    return [p for p in first.parameters() if id(p) in mine] if first is not last else []

"""Streaming DiLoCo's fragments and their schedule: which parameters sync together, and when.

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
2023, Algorithm 1) syncs the whole model every H inner steps: the network is idle for H steps,
then carries the whole model at once, so the *peak* bandwidth it needs is that of the model in
one burst. Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping
communication: Towards a Distributed Free Lunch", 2025, section 2.2) cuts the model into F
fragments and gives each its own schedule: every fragment is still synced once every H inner
steps, but fragment p at steps offset_p, offset_p + H, offset_p + 2H, ..., the offsets spread
evenly over the H steps. The total bytes are DiLoCo's; each burst is 1/F of them, so the peak
bandwidth over a window shorter than H falls by F. torchft's ``_StreamingDiLoCoFragment``
(``torchft/local_sgd.py``) has the same knob, ``fragment_sync_offset``.

The paper's fragments are strided over the layers (fragment p holds blocks p, p + F, ...) so
that a fragment is spread over the depth of the network; here a fragment is a contiguous run of
the parameters in ``named_parameters()`` order, each of about n / F elements (the GPT's
embedding, its blocks in order, the final LayerNorm): simpler to read, the same bytes and
schedule, which is what this module is about.

    fragment_offsets(4, 8)  -> [2, 4, 6, 8]       (step t syncs fragment p when t % 8 == offset % 8)
    due_fragments(6, 4, 8)  -> [2]
    due_fragments(8, 1, 8)  -> [0]                (F = 1: DiLoCo, every fragment at t % H == 0)
"""
from __future__ import annotations

import numpy


def check_schedule(fragments: int, sync_every: int) -> None:
    """Raise ValueError naming the fix unless ``fragments`` (F >= 1) and ``sync_every`` (H >= 1)
    are integers with F <= H (every fragment needs a step of its own within the H steps)."""
    for name, value in (("fragments", fragments), ("sync_every", sync_every)):
        if isinstance(value, bool) or not isinstance(value, (int, numpy.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if fragments > sync_every:
        raise ValueError(f"{fragments} fragments cannot each sync at its own step within --sync-every {sync_every} "
                         f"inner steps: use --fragments {sync_every} at most (or a larger --sync-every)")


def fragment_offsets(fragments: int, sync_every: int) -> list[int]:
    """The inner step (1..H) at which each of F fragments syncs first: (p + 1) H // F for
    fragment p, so the last one syncs at step H, as DiLoCo does, and the others evenly before it.
    Raises ValueError as :func:`check_schedule`."""
    check_schedule(fragments, sync_every)
    return [(p + 1) * sync_every // fragments for p in range(fragments)]


def due_fragments(step: int, fragments: int, sync_every: int) -> list[int]:
    """The fragments synced after inner step ``step`` (counting from 1): those whose offset is
    ``step`` modulo H. A list of fragment indices (empty on most steps when F < H)."""
    return [p for p, offset in enumerate(fragment_offsets(fragments, sync_every))
            if step >= offset and (step - offset) % sync_every == 0]


def split_parameters(params: list, fragments: int) -> list[list]:
    """Cut ``params`` (Tensors, in ``named_parameters()`` order) into ``fragments`` contiguous
    runs of about equal element counts: a parameter goes to the fragment in which its first
    element falls when the n elements are cut at k n / F. Returns F non-empty lists. Raises
    ValueError when there are fewer parameters than fragments (a fragment would be empty)."""
    params = list(params)
    if fragments > len(params):
        raise ValueError(f"the model has {len(params)} parameter tensors, fewer than --fragments {fragments}: every "
                         f"fragment needs at least one; use --fragments {len(params)} at most")
    total = sum(int(p.data.size) for p in params)
    runs, done = [[] for _ in range(fragments)], 0
    k = 0
    for i, p in enumerate(params):
        left = len(params) - i  # parameters not yet placed, p included
        if runs[k] and k < fragments - 1 and (done * fragments >= (k + 1) * total or left <= fragments - 1 - k):
            k += 1
        runs[k].append(p)
        done += int(p.data.size)
    return runs

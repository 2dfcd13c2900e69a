"""``--strategy cp`` declares itself: the variant of context-parallel attention (``--cp-variant``),
data parallelism beside it (the pipeline's ``--dp``: D groups of P / D ranks), tensor parallelism
inside it (the tp wing's ``--tp`` and ``--sequence-parallel``: each dp group is cp x tp ranks, tp
fastest), and what its runs can do (a global batch; fp32 only; checkpoints on the same layout)."""
from __future__ import annotations

from minidist.parallel.context_parallel.layout import VARIANTS
from minidist.parallel.context_parallel.train import check_context_parallel, train_context_parallel
from minidist.parallel.pipeline.strategy import DP
from minidist.parallel.tensor_parallel.strategy import SEQUENCE_PARALLEL, TP
from minidist.resharding import consolidate
from minidist.strategy import Flag, Strategy
from minidist.train import TrainConfig

CP_VARIANT = Flag("--cp-variant", "cp_variant", dict(
    choices=VARIANTS, help="cp: how attention reaches the other ranks' positions: ring (K/V blocks around a ring, "
                           "contiguous parts), zigzag (the same ring, chunks r and 2P-1-r: every rank the same work), "
                           "allgather (K/V all-gathered, Llama 3) or ulysses (all-to-all to heads and back; the cp "
                           f"ranks must divide --n-head / --tp) (default: {TrainConfig().cp_variant})"))

STRATEGY = Strategy(
    name="cp", driver=train_context_parallel,
    summary="cp (context parallelism: each rank a part of every sequence; --cp-variant, --dp, --tp; --model gpt "
            "only)",
    models=("gpt",), models_why=" (it cuts the transformer's sequences)", flags=(CP_VARIANT, DP, TP, SEQUENCE_PARALLEL),
    check=check_context_parallel, global_batch=True, replicas=lambda config, world_size: config.dp,
    one_batch=lambda config: "--strategy cp without --dp reads one batch a step" if config.dp == 1 else None,
    mixed_precision=lambda config: "; --strategy cp trains in fp32", consolidate=consolidate)

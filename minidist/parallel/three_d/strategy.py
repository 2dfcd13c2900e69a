"""``--strategy 3d`` declares itself: the GPT over a (dp, pp, tp) mesh takes the pipeline's flags,
tensor parallelism's and ZeRO-1's, the pipeline's rules between them, and resumes (without
``--zero``) on another mesh, its stages and shards joined and cut again."""
from __future__ import annotations

from minidist.parallel.pipeline import strategy as pipeline
from minidist.parallel.tensor_parallel import strategy as tensor_parallel
from minidist.parallel.three_d.train import check_3d, train_3d
from minidist.parallel.zero.strategy import ZERO
from minidist.strategy import Strategy

STRATEGY = Strategy(
    name="3d", driver=train_3d, summary="3d (data x pipeline x tensor parallelism on a mesh: --dp, --tp; --model gpt "
                                        "only)",
    models=("gpt",), models_why=" (it splits the transformer's layers)",
    flags=(*pipeline.FLAGS, tensor_parallel.TP, tensor_parallel.SEQUENCE_PARALLEL, ZERO),
    check=check_3d, check_flags=pipeline.check_flags, one_batch=pipeline.one_batch,
    replicas=lambda config, world_size: config.dp, global_batch=True,
    mixed_precision=lambda config: "; --strategy 3d trains in fp32",
    elastic=lambda config: not config.zero, elastic_label="3d (also another --tp; not with --zero)",
    resize_rule=lambda config: (f" (--strategy 3d needs a multiple of --dp {config.dp} x --tp {config.tp} with a "
                                "stage for each rank of a pipeline)"),
    layout_notes={**pipeline.LAYOUT_NOTES, **tensor_parallel.LAYOUT_NOTES}, relayout=pipeline.RELAYOUT,
    consolidate=pipeline.consolidate_pipeline)

"""The one registry: every way of training, one line per wing (``minidist.strategy.register``).

A strategy is its wing's ``STRATEGY`` record (``parallel/<wing>/strategy.py``); registering it
here is all the command line, the checkpointer and the launcher need to offer it: ``--strategy``'s
choices, the flags and their usage errors, elastic resume, ``checkpoint consolidate``. A variant
(ZeRO-1 for ``ddp --zero``, PipeDream for a pipeline that never flushes) is registered after its
strategy. The order is the order ``--strategy`` lists them in. Outside this file and the wings no
module names a strategy (``tests/test_strategy_registry.py`` says so).
"""
from __future__ import annotations

from minidist.parallel.context_parallel import strategy as context_parallel
from minidist.parallel.data_parallel import strategy as data_parallel
from minidist.parallel.expert_parallel import strategy as expert_parallel
from minidist.parallel.fsdp import strategy as fsdp
from minidist.parallel.local_sgd import strategy as local_sgd
from minidist.parallel.parameter_server import strategy as parameter_server
from minidist.parallel.pipeline import strategy as pipeline
from minidist.parallel.tensor_parallel import strategy as tensor_parallel
from minidist.parallel.three_d import strategy as three_d
from minidist.parallel.zero import strategy as zero
from minidist.resharding import consolidate
from minidist.strategy import Strategy, register
from minidist.train import train_single

# The one-process reference every parallel run must match: no wing of its own.
SINGLE = Strategy(
    name="single", driver=lambda comm, config, dataset, **kwargs: train_single(config, dataset, **kwargs),
    summary="single", one_process=True, one_batch=lambda config: "--strategy single has one worker",
    global_batch=True, replay=True, consolidate=consolidate,
    resume_hints={"tp": " (a tp checkpoint holds each rank's shards; it continues on one process as --strategy tp on 1 "
                        "rank, with --global-batch-size)"})

register(SINGLE)
register(data_parallel.STRATEGY)
register(zero.STRATEGY)  # ddp --zero
register(parameter_server.STRATEGY)
register(fsdp.STRATEGY)
register(tensor_parallel.STRATEGY)
register(pipeline.STRATEGY)
register(pipeline.PIPEDREAM)  # a pipeline that never flushes
register(three_d.STRATEGY)
register(context_parallel.STRATEGY)
register(expert_parallel.STRATEGY)
register(expert_parallel.MOE_SINGLE)  # single --n-expert: the one-process MoE GPT
register(local_sgd.STRATEGY)

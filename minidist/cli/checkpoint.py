"""``python -m minidist checkpoint consolidate DIR|FILE OUT``: a training checkpoint, whatever
the number of ranks, the sharding or the pipeline stages that wrote it, as one dense ``.npz`` of the model's
``state_dict`` (``train --save-model``'s format, which ``evaluate --checkpoint`` and ``generate``
read), as ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` does offline."""
from __future__ import annotations

import argparse
import os

import numpy as np

from minidist import strategy, workloads
from minidist.checkpoint_io import (
    CheckpointError,
    latest_valid_checkpoint,
    load_checkpoint,
    save_weights,
    unwritable,
)
from minidist.cli.train import check_save_model
from minidist.cli.values import fail
from minidist.resharding import ReshardError
from minidist.train import TrainConfig


def checkpoint_parser() -> argparse.ArgumentParser:
    """The ``checkpoint`` command's flags: one sub-command, ``consolidate``."""
    parser = argparse.ArgumentParser(prog="python -m minidist checkpoint",
                                     description="Work on the checkpoints of `train --checkpoint-dir`.")
    commands = parser.add_subparsers(dest="action", required=True, metavar="consolidate")
    one = commands.add_parser("consolidate", prog="python -m minidist checkpoint consolidate",
                              help="write a checkpoint's model weights to one dense .npz",
                              description=f"Write the model's weights of a checkpoint ({', '.join(consolidated())}; "
                                          "any number of ranks) to one dense .npz of its state_dict.")
    one.add_argument("source", metavar="DIR|FILE",
                     help="a --checkpoint-dir folder (its newest valid checkpoint) or one ckpt-<step>.npz")
    one.add_argument("out", metavar="OUT", help="the .npz to write (the state_dict, with the model's description)")
    return parser


def checkpoint_command(argv: list[str]) -> int:
    """``python -m minidist checkpoint consolidate DIR|FILE OUT``: read the checkpoint (a folder's
    newest valid one), rebuild the whole model's state_dict (``resharding.consolidate``: FSDP's
    pieces put back together from every rank's part; a replicated or ZeRO-1 checkpoint's
    weights as they are; tp's shards joined by ``tensor_parallel.join_shards``; a pipeline's or
    3d's stages by ``pipeline.elastic.consolidate_stages``, the model's shape from the
    checkpoint: each is the strategy record's ``consolidate``) and write it to OUT with the run's metadata
    (``checkpoint_io.save_weights``); prints one line naming what was written. Exit status 0; 1
    for a missing, unreadable or corrupt checkpoint, or OUT that cannot be written (a full disk:
    nothing half-written is left); 2 for a usage error: OUT not a writable
    ``.npz``, a checkpoint of a strategy whose parts are not pieces of one model (ps: named), or
    one whose pieces lack what consolidating needs (an older format)."""
    parser = checkpoint_parser()
    args = parser.parse_args(argv)
    try:
        check_save_model(args.out)
    except ValueError as problem:
        parser.error(str(problem).replace("--save-model", "OUT"))
    try:
        path, state = _read(args.source)
    except CheckpointError as error:
        return fail("checkpoint", str(error))
    config = state.get("config") if isinstance(state.get("config"), dict) else {}
    name = config.get("strategy", TrainConfig().strategy)  # a checkpoint older than the field: the default run's
    record = workloads.checkpoint_strategy({**config, "strategy": name})  # the variant: ddp --zero is ZeRO-1's
    if record is None or record.consolidate is None:
        parser.error(f"{path} is a checkpoint of --strategy {name}, whose ranks hold parts of other shapes "
                     f"(servers' shards); consolidate reads {strategy.listed(consolidated())} checkpoints")
    try:
        weights = record.consolidate(state)
    except (ReshardError, KeyError, TypeError, ValueError, RuntimeError) as error:
        parser.error(f"{path} cannot be consolidated: {error}")
    try:
        save_weights(args.out, weights, state.get("metadata"))
    except OSError as error:  # a full disk: atomic_file left nothing half-written
        return fail("checkpoint", str(unwritable(args.out, error, "OUT")))
    numbers = sum(int(np.asarray(v).size) for v in weights.values())
    tied = ""
    if (state.get("metadata") or {}).get("model") == "gpt" and {TIED, TIED_TO} <= weights.keys():
        numbers -= int(np.asarray(weights[TIED]).size)  # the head is the token embedding: one tensor, two names
        tied = f" (the tied {TIED} counted once)"
    flags = record.label if record.variant_of is not None else name  # a variant by its flags: "ddp --zero"
    print(f"consolidated {path} (step {state.get('step')}, --strategy {flags} on {config.get('world_size', 1)} "
          f"ranks): {len(weights)} tensors, {numbers} numbers{tied} -> {args.out}")
    return 0


TIED, TIED_TO = "lm_head.weight", "transformer.wte.weight"  # the GPT's head and the token embedding it is


def consolidated() -> list[str]:
    """How the strategies whose checkpoints consolidate are named (their records' labels)."""
    return [record.label for record in strategy.strategies() if record.consolidate is not None]


def _read(source: str):
    """``(path, state)`` of a checkpoint file or of a folder's newest valid one. Raises
    CheckpointError for a folder without any, or a file that does not load."""
    if os.path.isdir(source):
        found = latest_valid_checkpoint(source)
        if found is None:
            raise CheckpointError(f"checkpoint folder {source} holds no checkpoint (ckpt-<step>.npz)")
        return found
    state = load_checkpoint(source)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {source}: the state is {type(state).__name__}, not a dict")
    return os.fspath(source), state

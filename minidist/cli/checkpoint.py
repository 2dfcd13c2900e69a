"""``python -m minidist checkpoint consolidate DIR|FILE OUT``: a training checkpoint, whatever
the number of ranks and the sharding that wrote it, as one dense ``.npz`` of the model's
``state_dict`` (``train --save-model``'s format, which ``evaluate --checkpoint`` and ``generate``
read), as ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` does offline."""
from __future__ import annotations

import argparse
import os

import numpy as np

from minidist.checkpoint_io import CheckpointError, latest_valid_checkpoint, load_checkpoint, save_weights
from minidist.cli.train import check_save_model
from minidist.cli.values import fail
from minidist.parallel.tensor_parallel import join_shards
from minidist.resharding import ReshardError, consolidate

# The strategies whose checkpoints hold the whole model, or its pieces with their offsets, or (tp)
# each rank's shards of every parameter in rank order.
CONSOLIDATED = ("single", "ddp", "fsdp", "tp")


def checkpoint_parser() -> argparse.ArgumentParser:
    """The ``checkpoint`` command's flags: one sub-command, ``consolidate``."""
    parser = argparse.ArgumentParser(prog="python -m minidist checkpoint",
                                     description="Work on the checkpoints of `train --checkpoint-dir`.")
    commands = parser.add_subparsers(dest="action", required=True, metavar="consolidate")
    one = commands.add_parser("consolidate", prog="python -m minidist checkpoint consolidate",
                              help="write a checkpoint's model weights to one dense .npz",
                              description="Write the model's weights of a checkpoint (single, ddp, ddp --zero, fsdp, "
                                          "tp; any number of ranks) to one dense .npz of its state_dict.")
    one.add_argument("source", metavar="DIR|FILE",
                     help="a --checkpoint-dir folder (its newest valid checkpoint) or one ckpt-<step>.npz")
    one.add_argument("out", metavar="OUT", help="the .npz to write (the state_dict, with the model's description)")
    return parser


def checkpoint_command(argv: list[str]) -> int:
    """``python -m minidist checkpoint consolidate DIR|FILE OUT``: read the checkpoint (a folder's
    newest valid one), rebuild the whole model's state_dict (``resharding.consolidate``: FSDP's
    pieces put back together from every rank's part; a replicated or ZeRO-1 checkpoint's
    weights as they are; tp's shards joined by ``tensor_parallel.join_shards``) and write it
    to OUT with the run's metadata (``checkpoint_io.save_weights``); prints one line naming
    what was written. Exit status 0; 1 for a missing, unreadable or corrupt checkpoint; 2 for a
    usage error: OUT not a writable ``.npz``, a checkpoint of a strategy whose parts are not
    pieces of one model (pipeline, 3d, ps: named), or one whose pieces lack what consolidating
    needs (an older format)."""
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
    strategy = config.get("strategy", "single")
    if strategy not in CONSOLIDATED:
        parser.error(f"{path} is a checkpoint of --strategy {strategy}, whose ranks hold parts of other shapes "
                     "(stages, servers' shards); consolidate reads single, ddp (also --zero), fsdp and tp "
                     "checkpoints")
    try:
        weights = _join_tensor_parallel(state) if strategy == "tp" else consolidate(state)
    except (ReshardError, KeyError, TypeError, ValueError, RuntimeError) as error:
        parser.error(f"{path} cannot be consolidated: {error}")
    save_weights(args.out, weights, state.get("metadata"))
    numbers = sum(int(np.asarray(v).size) for v in weights.values())
    print(f"consolidated {path} (step {state.get('step')}, --strategy {strategy} on {config.get('world_size', 1)} "
          f"ranks): {len(weights)} tensors, {numbers} numbers -> {args.out}")
    return 0


def _join_tensor_parallel(state: dict) -> dict:
    """The dense state_dict of a tp checkpoint: each parameter's shards, one per rank of
    ``state["ranks"]`` (rank order), joined as the split model cut them (``join_shards``; a
    parameter every rank holds whole is rank 0's, a RuntimeError when the copies differ)."""
    parts = state["ranks"]
    return {name: join_shards(name, [np.asarray(part["model"][name]) for part in parts])
            for name in parts[0]["model"]}


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

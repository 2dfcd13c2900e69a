"""``python -m minidist checkpoint consolidate DIR|FILE OUT``: a training checkpoint, whatever
the number of ranks, the sharding or the pipeline stages that wrote it, as one dense ``.npz`` of the model's
``state_dict`` (``train --save-model``'s format, which ``evaluate --checkpoint`` and ``generate``
read), as ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` does offline."""
from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import numpy as np

from minidist import nn
from minidist.checkpoint_io import CheckpointError, latest_valid_checkpoint, load_checkpoint, save_weights
from minidist.cli.train import check_save_model
from minidist.cli.values import fail
from minidist.models.gpt import GPT, GPTConfig
from minidist.parallel.pipeline.elastic import PipelineLayout, consolidate_stages
from minidist.parallel.pipeline.train import model_stages
from minidist.parallel.tensor_parallel import join_shards
from minidist.resharding import ReshardError, consolidate

# The strategies whose checkpoints hold the whole model, or its pieces with their offsets, or (tp)
# each rank's shards of every parameter in rank order, or (pipeline, 3d) each rank's stages (and
# their tp shards) under the stages' names.
CONSOLIDATED = ("single", "ddp", "fsdp", "tp", "pipeline", "3d")


def checkpoint_parser() -> argparse.ArgumentParser:
    """The ``checkpoint`` command's flags: one sub-command, ``consolidate``."""
    parser = argparse.ArgumentParser(prog="python -m minidist checkpoint",
                                     description="Work on the checkpoints of `train --checkpoint-dir`.")
    commands = parser.add_subparsers(dest="action", required=True, metavar="consolidate")
    one = commands.add_parser("consolidate", prog="python -m minidist checkpoint consolidate",
                              help="write a checkpoint's model weights to one dense .npz",
                              description="Write the model's weights of a checkpoint (single, ddp, ddp --zero, fsdp, "
                                          "tp, pipeline, 3d; any number of ranks) to one dense .npz of its "
                                          "state_dict.")
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
    checkpoint: :func:`stage_model`) and write it to OUT with the run's metadata
    (``checkpoint_io.save_weights``); prints one line naming what was written. Exit status 0; 1
    for a missing, unreadable or corrupt checkpoint; 2 for a usage error: OUT not a writable
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
    strategy = config.get("strategy", "single")
    if strategy not in CONSOLIDATED:
        parser.error(f"{path} is a checkpoint of --strategy {strategy}, whose ranks hold parts of other shapes "
                     "(servers' shards); consolidate reads single, ddp (also --zero), fsdp, tp, pipeline and 3d "
                     "checkpoints")
    try:
        if strategy in ("pipeline", "3d"):
            model, split = stage_model(state)
            weights = consolidate_stages(state, model, split)
        else:
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


def stage_model(state: dict):
    """A model of the shape a pipeline or 3-D checkpoint ``state`` trained (its values unused) and
    ``split(num_stages)``, its cut into stages as the drivers cut it (``pipeline.train.
    model_stages``): the GPT of the saved ``metadata``'s configuration, or the MLP of the
    fingerprint's --hidden with the features read off the first stage's first Linear weight and
    the classes off the last stage's last one. Raises KeyError or ValueError when the checkpoint
    lacks them."""
    config = state["config"]
    if config.get("model") == "gpt":
        model = GPT(GPTConfig(**state["metadata"]["gpt_config"]))
    else:
        layout, parts = PipelineLayout.of(config), state["ranks"]
        last = parts[layout.rank(0, layout.pp - 1)]["model"]  # its last stage is the model's: the last Linear
        prefix = f"{layout.stages_per_rank - 1}."
        final = max((key for key in last if key.startswith(prefix) and key.endswith(".weight")),
                    key=lambda key: int(key.split(".")[1]))
        sizes = [parts[0]["model"]["0.0.weight"].shape[1], *config["hidden"], last[final].shape[0]]
        model = nn.mlp(sizes)
    shape = SimpleNamespace(model=config.get("model", "mlp"), n_layer=config.get("n_layer"))
    return model, lambda n: model_stages(shape, model, n)


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

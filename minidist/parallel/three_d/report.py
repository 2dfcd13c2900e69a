"""What a 3-D run reports: pipeline 0's tensor-parallel shards joined into a dense GPT on rank
0 (to score it, sample from it and save it), one line per evaluation interval with the bubble
and the bytes each group of the mesh sent, and the run's figures, each rank's gathered.
Used by :class:`~minidist.parallel.three_d.train.ThreeDRun`."""
from __future__ import annotations

from minidist import backend, memory
from minidist.collectives import gather, gather_objects
from minidist.parallel.pipeline.grid import ProcessGrid
from minidist.parallel.pipeline.report import measured_bubble
from minidist.parallel.tensor_parallel.gpt import join_shards
from minidist.train import TrainConfig, global_batch


def gather_dense(comm, grid: ProcessGrid, model, owned: set, dense) -> None:
    """Load pipeline 0's shards of every parameter into ``dense`` on rank 0 of ``comm``.
    Collective over ``comm``: every rank of pipeline 0 (dp_rank 0) sends {name: array} of the
    parameters its stages hold (``owned``: their ids; names as ``model``'s, the dense GPT's),
    the other ranks an empty dict, in one ``gather_objects``; rank 0 joins each name's shards
    in tp order from the first pipeline rank that holds it (``tensor_parallel.join_shards``)."""
    mesh = grid.mesh
    mine = {}
    if grid.dp_rank == 0:
        mine = {name: backend.to_numpy(p.data) for name, p in model.named_parameters(remove_duplicate=False)
                if id(p) in owned}
    everyone = gather_objects(comm, (mesh.coordinate, mine))
    if everyone is None:
        return
    state = {}
    for name in dense.state_dict():
        holders = sorted(((coordinate, part[name]) for coordinate, part in everyone if name in part),
                         key=lambda holder: holder[0])
        first_stage = holders[0][0][1]
        shards = [array for (d, s, _), array in holders if s == first_stage]
        state[name] = join_shards(name, shards) if mesh.size("tp") > 1 else shards[0]
    dense.load_state_dict(state)


def interval_reporter(comm, work, grid, model, dense, optimizer, step, log, simulated: float):
    """``train_3d``'s ``on_epoch_end`` (every rank: pipeline 0's shards joined into ``dense`` on
    rank 0, every rank's busy and step seconds, bytes by group, parameter and optimizer-state
    bytes gathered there; rank 0 scores and logs one line) and the dict where rank 0 keeps the
    last interval's figures. ``step``: the ``StepBytes`` around the ``ThreeDStep``."""
    pipeline_step, last = step.step_fn, {}
    params = pipeline_step.params

    def report(epoch, loss, seconds):
        gather_dense(comm, grid, model, {id(p) for p in params}, dense)
        times = gather(comm, pipeline_step.measurements()[:2], root=0)
        held = {"sent": dict(step.bytes_by), "steps": step.steps, "parameters": memory.parameter_bytes(params),
                "optimizer_state": memory.optimizer_state_bytes(optimizer)}
        everyone = gather_objects(comm, held)
        pipeline_step.reset_measurements()
        if comm.Get_rank() != 0:
            return None
        bubble = measured_bubble(times[:, 0], times[:, 1])
        last.update(bubble=bubble, everyone=everyone)
        mine = {name: b / max(everyone[0]["steps"], 1) for name, b in everyone[0]["sent"].items()}
        extra = (f"  bubble={bubble:.3f} (simulated {simulated:.3f})  sent/step tp={mine['tp'] / 1e6:.3f} "
                 f"pp={mine['pp'] / 1e6:.3f} dp={mine['dp'] / 1e6:.3f}MB (rank 0)")
        row = work.report(dense, epoch, loss, seconds, log, extra, world_size=grid.dp_size)
        row.update(bubble=bubble)
        return row

    return report, last


def run_figures(config: TrainConfig, world_size: int, layout: tuple, lr: float, last: dict) -> dict:
    """The figures of ``train_3d``'s result (its docstring) from the last report's ``last``."""
    dp, pp, tp = layout
    everyone = last.get("everyone") or [{"sent": {"tp": 0, "pp": 0, "dp": 0}, "steps": 0, "parameters": 0,
                                         "optimizer_state": 0}] * world_size
    per_step = [{name: round(b / max(r["steps"], 1)) for name, b in r["sent"].items()} for r in everyone]
    return {
        "ranks": world_size, "dp": dp, "pp": pp, "tp": tp,
        "sequence_parallel": "on" if config.sequence_parallel else "off", "zero": "on" if config.zero else "off",
        "schedule": config.schedule, "microbatches": config.microbatches, "global_batch": global_batch(config, dp),
        "lr": f"{lr:g}", "bubble": f"{last['bubble']:.3f}" if "bubble" in last else "nan",
        **{f"{name}_bytes_per_step": ",".join(str(s[name]) for s in per_step) for name in ("tp", "pp", "dp")},
        **{f"{name}_bytes": sum(r["sent"][name] for r in everyone) for name in ("tp", "pp", "dp")},
        "steps_counted": everyone[0]["steps"],
        "parameter_bytes": ",".join(str(r["parameters"]) for r in everyone),
        "optimizer_state_bytes": ",".join(str(r["optimizer_state"]) for r in everyone),
    }



"""``--strategy ps`` declares itself: the servers' flags, their rule, and what a parameter
server's run cannot do (a global batch, mixed precision, an exact checkpoint out of sync mode,
resuming on another layout)."""
from __future__ import annotations

from minidist.parallel.parameter_server.protocol import check_world
from minidist.parallel.parameter_server.train import train_ps
from minidist.strategy import Flag, Strategy
from minidist.train import PS_MODES

PS_MODE = Flag("--ps-mode", "ps_mode", dict(
    choices=PS_MODES, help="ps: sync, async, or ssp (bounded staleness) (default: sync)"))
NUM_SERVERS = Flag("--num-servers", "num_servers", dict(
    type="positive_int", help="ps: parameter-server ranks K (default: 1)"))
STALENESS = Flag("--staleness", "staleness", dict(
    type="nonnegative_int", help="ps with --ps-mode ssp: how many versions a worker may lag behind (default: 2)"))


def check_flags(config, given: set) -> None:
    """Raise ValueError for ``--staleness`` outside ssp mode (the bound it sets is ssp's)."""
    if "staleness" in given and config.ps_mode != "ssp":
        raise ValueError(f"--staleness applies to --ps-mode ssp only (the bound of stale synchronous parallel), "
                         f"not to --ps-mode {config.ps_mode}")


def checkpoints(config) -> str | None:
    """Why a run of ``config`` has no exact state to save (async and ssp modes), or None."""
    if config.ps_mode == "sync":
        return None
    return (f"applies to --ps-mode sync only: in {config.ps_mode} the parameters a worker pulls depend on timing, so "
            "no run, resumed or not, repeats another; there is no exact state to resume")


STRATEGY = Strategy(
    name="ps", driver=train_ps, summary="ps (parameter servers)", models=("mlp",),
    flags=(PS_MODE, NUM_SERVERS, STALENESS), check_flags=check_flags,
    check=lambda world_size, config: check_world(world_size, config.num_servers, config.ps_mode, config.staleness),
    one_batch=lambda config: ("--ps-mode async applies each worker's gradient with its own batch"
                              if config.ps_mode == "async" else None),
    batch_why=" (the batch of each worker: in async and ssp modes each worker's gradient is applied alone, so no "
              "step has one global batch, and a ps checkpoint resumes on its own servers and workers only)",
    mixed_precision=lambda config: ", not to --strategy ps", checkpoints=checkpoints,
    resume_note="a ps checkpoint on its own layout only")

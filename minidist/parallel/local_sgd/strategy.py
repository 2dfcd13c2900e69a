"""``--strategy diloco`` declares itself: the inner steps between syncs (``--sync-every``), the
outer optimizer (``--outer-lr``, ``--outer-momentum``, ``--nesterov``), Streaming DiLoCo's
``--fragments``, DDP's ``--comm-hook`` for the pseudo-gradients and the pipeline's ``--dp`` for
replica groups; fp32 only, no checkpoints (a replica that restarts joins from a peer)."""
from __future__ import annotations

from minidist.parallel.data_parallel.strategy import COMM_HOOK
from minidist.parallel.local_sgd.train import check_diloco, train_diloco
from minidist.parallel.pipeline.strategy import DP
from minidist.strategy import Flag, Strategy
from minidist.train import TrainConfig

_D = TrainConfig()
SYNC_EVERY = Flag("--sync-every", "sync_every", dict(
    type="positive_int", metavar="H", help=f"diloco: inner steps between syncs of the replicas (default: "
                                           f"{_D.sync_every})"))
OUTER_LR = Flag("--outer-lr", "outer_lr", dict(
    type="positive_float", help=f"diloco: the outer SGD's learning rate on the pseudo-gradients (default: "
                                f"{_D.outer_lr:g}; 1 without momentum is parameter averaging)"))
OUTER_MOMENTUM = Flag("--outer-momentum", "outer_momentum", dict(
    type="probability", help=f"diloco: the outer SGD's momentum, in [0, 1) (default: {_D.outer_momentum:g})"))
NESTEROV = Flag("--nesterov", "nesterov", dict(
    action="boolean_optional", help="diloco: Nesterov momentum in the outer SGD (default: on, as in DiLoCo; "
                                    "--no-nesterov: plain momentum)"))
FRAGMENTS = Flag("--fragments", "fragments", dict(
    type="positive_int", help=f"diloco: Streaming DiLoCo, the model in this many fragments synced at staggered "
                              f"steps (at most --sync-every; default: {_D.fragments}, plain DiLoCo)"))


def check_flags(config, given: set) -> None:
    """Raise ValueError for diloco's flags that do not go together: more fragments than inner
    steps between syncs."""
    if "fragments" in given or "sync_every" in given:
        if config.fragments > config.sync_every:
            raise ValueError(f"--fragments {config.fragments} needs --sync-every {config.fragments} or more: each "
                             "fragment syncs at a step of its own within the H inner steps")


STRATEGY = Strategy(
    name="diloco", driver=train_diloco,
    summary="diloco (DiLoCo: replicas sync every --sync-every H steps; --fragments, --dp replica groups)",
    flags=(SYNC_EVERY, OUTER_LR, OUTER_MOMENTUM, NESTEROV, FRAGMENTS, COMM_HOOK, DP), check_flags=check_flags,
    check=check_diloco,
    mixed_precision=lambda config: "; --strategy diloco trains in fp32",
    checkpoints=lambda config: ("does not apply to --strategy diloco: its outer state (the global weights and "
                                "the outer momentum) is not in the checkpoint; a replica that restarts joins from a "
                                "healthy peer instead"))

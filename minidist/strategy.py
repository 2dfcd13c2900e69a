"""What a way of training declares about itself: the :class:`Strategy` record and its :class:`Flag`.

Each wing of ``minidist.parallel`` exports one ``STRATEGY`` (``parallel/<wing>/strategy.py``),
and ``minidist.parallel.registry`` lists them, one line each. Everything outside a wing that
must know what a strategy can do reads it off the record: the command line builds ``--strategy``'s
choices, the wings' flags, their help and their usage errors from it; ``launch --min-ranks`` asks it
whether a run is elastic; ``checkpoint consolidate`` asks it how to join its checkpoints; the
checkpointer (``minidist.fault``) and ``generate`` look up the record of the strategy a config or a
checkpoint names. So the engine names no strategy, and adding one is its folder plus one line in
the registry. The idea is torchtitan's ``TrainSpec`` (``torchtitan/protocols/train_spec.py``): a
dataclass per model naming the functions that build, parallelise and pipeline it, kept in a
module-level table by ``register_train_spec`` and looked up by ``get_train_spec``.

A record holds functions, not subclasses: each takes the run's ``TrainConfig`` (and, where said,
the set ``given`` of its fields the user set on the command line) and answers one question. The
defaults answer "no restriction", so a record states only what is special about its strategy.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


def _no(*_) -> None:
    return None


def _never(*_) -> bool:
    return False


@dataclass(frozen=True)
class Flag:
    """One command-line flag a wing owns (defined once, in its wing; any record may take it).

    flag: its spelling (``"--zero"``). field: the ``TrainConfig`` field it sets (``"zero"``).
    options: the command line parser's ``add_argument`` keywords (type, choices, action, help);
    the parser's default is None, so a flag given to a strategy that does not take it is seen
    and refused; the value it stands for when left out is ``TrainConfig``'s. why: a few words
    said after "applies to --strategy X only" when it is refused (``" (the hooks compress ...)"``).
    """

    flag: str
    field: str
    options: dict
    why: str = ""


@dataclass(frozen=True)
class Strategy:
    """A way of training, as ``train --strategy NAME`` runs it (module docstring).

    name: the ``--strategy`` value (or, for a variant, a name of its own: ``zero``, ``pipedream``).
    driver: ``driver(comm, config, dataset, **kwargs) -> TrainResult | None`` (comm None when
    ``one_process``). summary: its few words in ``--strategy``'s help. label: how lists of
    strategies name it (default: name; ``"ddp (also --zero)"``).
    models: the ``--model`` values it trains; models_why: said when another model is asked for.
    flags: the :class:`Flag` records it takes (owned by this wing or another).
    variant_of, when: a variant is trained instead of its base strategy when ``when(config)``
    holds (``ddp --zero`` by ZeRO-1's driver, a pipeline that never flushes by PipeDream's); it
    adds its flags to the base's. check: ``check(world_size, config)`` raises ValueError naming the
    fix for a layout it cannot run. check_flags: ``check_flags(config, given)`` raises ValueError
    for its own flags that do not go together.
    one_process: it runs without MPI (single). one_batch: ``one_batch(config)`` is why every rank
    reads one batch (so ``--scale-lr`` has nothing to scale), or None. global_batch: it takes
    ``--global-batch-size``. replicas: ``replicas(config, world_size)``, the ranks that split the
    global batch (default: all of them). batch_why: said after "give it --batch-size instead" when
    it does not take a global batch.
    mixed_precision: ``mixed_precision(config)`` is why it trains in fp32 only, or None.
    checkpoints: ``checkpoints(config)`` is why it has no exact state to save (the words after
    the refused flag), or None. replay: ``--replay-step`` reruns its steps.
    elastic: ``elastic(config)``: a checkpoint of this run resumes on another number of ranks
    (with a global batch); elastic_label: how the sentence listing those strategies names it
    (default: label); resume_note: a note that sentence ends with (``"a ps checkpoint on its own
    layout only"``); relayout: the fields whose change at the same number of ranks still cuts the
    checkpoint again (a pipeline's dp, tp, stages per rank, schedule). resize_rule:
    ``resize_rule(config)``, the rule on the numbers of ranks it can shrink to (``launch
    --min-ranks``), said when none fits; None: any number up to G.
    layout_notes: {field: what a change of it on resume means}, the layout fields besides the
    world size that an elastic resume may change. resume_hints: {strategy of a checkpoint: a hint
    said when this strategy cannot resume it}. consolidate: ``consolidate(state) -> {name: array}``,
    the dense model of one of its checkpoints, or None when its ranks hold parts of other shapes.
    defaults: ``defaults(config) -> {field: value}``, its own defaults of shared fields (a
    pipeline's deeper MLP and smaller lr), applied where the user gave no value.
    """

    name: str
    driver: Callable
    summary: str
    label: str = ""
    models: tuple = ("mlp", "gpt")
    models_why: str = ""
    flags: tuple = ()
    variant_of: str | None = None
    when: Callable = _never
    check: Callable | None = None
    check_flags: Callable = _no
    one_process: bool = False
    one_batch: Callable = _no
    global_batch: bool = False
    batch_why: str = ""
    replicas: Callable = field(default=lambda config, world_size: world_size)
    mixed_precision: Callable = _no
    checkpoints: Callable = _no
    replay: bool = False
    elastic: Callable = _never
    elastic_label: str = ""
    resume_note: str = ""
    relayout: tuple = ()
    resize_rule: Callable | None = None
    layout_notes: dict = field(default_factory=dict)
    resume_hints: dict = field(default_factory=dict)
    consolidate: Callable | None = None
    defaults: Callable = field(default=lambda config: {})

    def __post_init__(self):
        for name in ("label", "elastic_label"):
            if not getattr(self, name):
                object.__setattr__(self, name, self.name if name == "label" else self.label)

    @property
    def variants(self) -> list[Strategy]:
        """The registered records that train some runs of this one instead (:func:`resolve`)."""
        return [record for record in _RECORDS.values() if record.variant_of == self.name]

    @property
    def all_flags(self) -> tuple:
        """Its flags and its variants' (``ddp`` takes ``--zero``: ZeRO-1's)."""
        return self.flags + tuple(flag for variant in self.variants for flag in variant.flags)


def listed(names, last: str = "and") -> str:
    """``"a"``, ``"a and b"``, ``"a, b and c"``: names (strings) as a sentence lists them."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


# ---------------------------------------------------------------------------------------
# The table: filled by ``minidist.parallel.registry`` (one line per wing), read by name
# ---------------------------------------------------------------------------------------

_RECORDS: dict[str, Strategy] = {}


def register(record: Strategy) -> Strategy:
    """Add ``record`` to the table (``minidist.parallel.registry`` calls it once per record, when
    ``minidist`` is imported). Returns it. Raises ValueError for a name registered twice, or a
    variant registered before its base strategy."""
    if record.name in _RECORDS:
        raise ValueError(f"a strategy named {record.name!r} is registered already")
    if record.variant_of is not None and record.variant_of not in _RECORDS:
        raise ValueError(f"register --strategy {record.variant_of} before its variant {record.name!r}")
    _RECORDS[record.name] = record
    return record


def strategies() -> list[Strategy]:
    """The ``--strategy`` choices' records, in the order they were registered (no variants)."""
    return [record for record in _RECORDS.values() if record.variant_of is None]


def all_records() -> list[Strategy]:
    """Every registered record, variants included, in the order they were registered."""
    return list(_RECORDS.values())


def names() -> tuple:
    """The ``--strategy`` choices, in the order they were registered."""
    return tuple(record.name for record in strategies())


def get(name: str) -> Strategy:
    """The record registered as ``name`` (a strategy or a variant). Raises ValueError naming the
    choices for an unknown name."""
    try:
        return _RECORDS[name]
    except KeyError:
        raise ValueError(f"no strategy is named {name!r}; the strategies are {', '.join(names())}") from None


def resolve(config) -> Strategy:
    """The record that trains ``config``: the first variant of ``config.strategy`` whose
    ``when(config)`` holds (``ddp --zero``: ZeRO-1's), else the strategy's own."""
    base = get(config.strategy)
    return next((variant for variant in base.variants if variant.when(config)), base)


def is_elastic(config) -> bool:
    """Whether a run of ``config`` may resume a checkpoint written on another number of ranks
    (or another layout, :attr:`Strategy.layout_notes`): ``--global-batch-size`` given and the
    record that trains it (:func:`resolve`) says so (``Strategy.elastic``)."""
    if getattr(config, "global_batch_size", None) is None or getattr(config, "strategy", None) not in _RECORDS:
        return False
    return bool(resolve(config).elastic(config))


def elastic_labels() -> list[str]:
    """How the strategies whose checkpoints reshard are named in a sentence, variants included
    (``["ddp", "ddp --zero", ...]``), in the table's order."""
    return [record.elastic_label for record in _RECORDS.values() if record.elastic is not _never]


def layout_fields() -> set:
    """Every field some strategy's elastic resume may change besides the world size."""
    return {name for record in _RECORDS.values() for name in record.layout_notes}


def layout_hint() -> str:
    """What a refused resume says when only the layout differs: which strategies reshard."""
    notes = "".join(f"; {record.resume_note}" for record in _RECORDS.values() if record.resume_note)
    return (f" (a checkpoint resumes on another number of ranks with --global-batch-size, for --strategy "
            f"{listed(elastic_labels())}{notes})")

"""The strategies declare themselves (``minidist.strategy``, ``minidist.parallel.registry``): no
module outside a wing and the registry names one, and a new record registered is all the
command line needs to offer it (issue 30, item 1)."""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from minidist import strategy, train
from minidist.cli import train_flags
from minidist.strategy import Flag, Strategy

PACKAGE = Path(__file__).resolve().parents[1] / "minidist"
WINGS = PACKAGE / "parallel"
REGISTRY = WINGS / "registry.py"
# The strings equal to a strategy's name that name something else, by module: "tp" the config's
# field (the tensor-parallel degree), a mesh dimension or a planner's term; "ep" the planner's
# expert-parallel degree and its time term; "single" the config's default strategy; the wings'
# modules in the parallel package's face (its __all__).
ALLOWED = {"planner.py": {"tp", "ep"}, "cli/plan.py": {"tp", "ep"}, "course/explorers.py": {"tp"},
           "course/checks/mesh.py": {"tp"}, "course/checks/layout_search.py": {"tp"}, "fault.py": {"tp"},
           "train/config.py": {"single"},
           "parallel/__init__.py": {"pipeline", "fsdp"}}


def outside_the_wings() -> list[Path]:
    """Every engine, course and command-line module: not a wing's folder, not the registry."""
    return [path for path in sorted(PACKAGE.rglob("*.py"))
            if not (path.is_relative_to(WINGS) and (path.parent != WINGS or path == REGISTRY))]


def docstrings(tree) -> set[int]:
    """The ids of the string constants that are docstrings (prose about the code, not its data)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def strategy_strings(path: Path, names, rel: str | None = None) -> list[str]:
    """``rel:line text`` of each string constant (not a docstring) of ``path`` (``rel``: its place
    in the package) that is a strategy's name or says ``--strategy NAME``."""
    tree = ast.parse(path.read_text())
    skip, rel = docstrings(tree), rel or path.relative_to(PACKAGE).as_posix()
    allowed = ALLOWED.get(rel, set())
    pattern = re.compile(r"--strategy (" + "|".join(map(re.escape, names)) + r")\b")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if (node.value in names and node.value not in allowed) or pattern.search(node.value):
                found.append(f"{rel}:{node.lineno} {node.value[:60]!r}")
    return found


def test_no_strategy_is_named_outside_its_wing_and_the_registry():
    names = strategy.names()
    assert set(names) >= {"single", "ddp", "ps", "pipeline", "tp", "fsdp", "3d"}
    found = [hit for path in outside_the_wings() for hit in strategy_strings(path, names)]
    assert found == []


def test_the_guard_sees_a_name_and_a_flag_in_a_message(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""--strategy ddp in a docstring is prose."""\n'
                     'A = "ddp"\nB = f"use --strategy tp {A}"\nC = "tpx --strategy tpx"\n')
    hits = strategy_strings(probe, ("ddp", "tp"), rel="probe.py")
    assert [hit.split(" ", 1)[1] for hit in hits] == ["'ddp'", "'use --strategy tp '"]


@pytest.fixture
def toy_registry(monkeypatch):
    """The registry with one more strategy, ``toy``: one record and one ``register`` line."""
    monkeypatch.setattr(strategy, "_RECORDS", dict(strategy._RECORDS))
    speed = Flag("--toy-speed", "toy_speed", dict(type="positive_int", help="toy: how fast"))

    def driver(comm, config, dataset, **kwargs):
        return train.TrainResult(test_accuracy=1.0, figures={"toy": config.strategy})

    record = Strategy(name="toy", driver=driver, summary="toy (a strategy a test adds)", models=("mlp",),
                      flags=(speed,), global_batch=True)
    strategy.register(record)
    return record


def test_one_record_and_one_registration_line_add_a_strategy(toy_registry, monkeypatch):
    parser = train_flags.train_parser()
    assert "toy" in strategy.names() and "toy (a strategy a test adds)" in parser.format_help()
    monkeypatch.setattr(train_flags, "TrainConfig", _with_field("toy_speed", 1))
    config = train_flags.train_config(parser.parse_args(["--strategy", "toy", "--toy-speed", "3"]))
    assert config.strategy == "toy" and config.toy_speed == 3
    with pytest.raises(ValueError, match=r"--toy-speed applies to --strategy toy only, not to --strategy ddp"):
        train_flags.train_config(parser.parse_args(["--strategy", "ddp", "--toy-speed", "3"]))
    with pytest.raises(ValueError,
                       match=r"--comm-hook applies to --strategy ddp (and diloco )?only .* not to --strategy toy"):
        train_flags.train_config(parser.parse_args(["--strategy", "toy", "--comm-hook", "fp16"]))
    with pytest.raises(ValueError, match=r"--strategy toy trains --model mlp only"):
        train_flags.train_config(parser.parse_args(["--strategy", "toy", "--model", "gpt"]))


def _with_field(name, default):
    """TrainConfig with one more field (what a new wing's flag would add to the config)."""
    return dataclasses.make_dataclass("TrainConfig", [(name, int, dataclasses.field(default=default))],
                                      bases=(train.TrainConfig,))


def test_a_variant_comes_after_its_strategy_and_names_are_unique(monkeypatch):
    monkeypatch.setattr(strategy, "_RECORDS", dict(strategy._RECORDS))
    with pytest.raises(ValueError, match="registered already"):
        strategy.register(Strategy(name="ddp", driver=print, summary="again"))
    with pytest.raises(ValueError, match="register --strategy nowhere before its variant"):
        strategy.register(Strategy(name="v", driver=print, summary="v", variant_of="nowhere"))
    with pytest.raises(ValueError, match="no strategy is named 'nothing'; the strategies are single, ddp"):
        strategy.get("nothing")


@pytest.mark.parametrize("fields,name", [
    ({"strategy": "ddp"}, "ddp"), ({"strategy": "ddp", "zero": True}, "zero"),
    ({"strategy": "pipeline", "schedule": "pipedream"}, "pipedream"), ({"strategy": "pipeline"}, "pipeline"),
    ({"strategy": "3d", "zero": True}, "3d")])
def test_a_config_is_trained_by_its_strategy_or_its_variant(fields, name):
    assert strategy.resolve(train.TrainConfig(**fields)).name == name


def test_elastic_runs_are_the_records_say():
    elastic = {name for name in strategy.names()
               if strategy.is_elastic(train.TrainConfig(strategy=name, global_batch_size=8))}
    assert elastic == {"ddp", "fsdp", "tp", "pipeline", "3d"}
    assert not strategy.is_elastic(train.TrainConfig(strategy="3d", zero=True, global_batch_size=8))
    assert strategy.is_elastic(train.TrainConfig(strategy="ddp", zero=True, global_batch_size=8))
    assert not strategy.is_elastic(train.TrainConfig(strategy="ddp"))  # no global batch

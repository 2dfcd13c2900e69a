"""python -m minidist: one parser module; usage errors exit 2 with a message naming the flag,
never a traceback, and never run the command."""
import subprocess
import sys
from pathlib import Path

import pytest

from minidist import cli
from minidist.course import runner

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args,message", [
    (["--timeout", "0"], "argument --timeout: must be a finite number > 0, got 0"),
    (["--timeout", "nan"], "argument --timeout: must be a finite number > 0, got nan"),
    (["--timeout", "-1"], "argument --timeout: must be a finite number > 0, got -1"),
    (["--timeout", "inf"], "argument --timeout: must be a finite number > 0, got inf"),
    (["--ranks", "0"], "argument --ranks/-n: must be a positive integer, got 0"),
    (["-n", "two"], "argument --ranks/-n: expected an integer, got 'two'"),
])
def test_check_bad_values_are_usage_errors(args, message, capsys, monkeypatch):
    # A real exercise folder, so only the flag can make this a usage error.
    monkeypatch.setattr(runner, "run_check", lambda *a, **k: pytest.fail("check ran with a bad flag"))
    assert cli.main(["check", "00", "--exercises", str(ROOT / "exercises"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_check_passes_its_values_to_the_runner(monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "run_check", lambda chapter, **kwargs: calls.append((chapter, kwargs)) or 0)
    assert cli.main(["check", "3", "--timeout", "7.5", "-n", "2", "--exercises", "ex"]) == 0
    assert calls == [("03", {"timeout": 7.5, "ranks": 2, "exercises": Path("ex")})]


@pytest.mark.parametrize("argv,status", [([], 2), (["-h"], 0), (["frobnicate"], 2), (["train", "-h"], 0)])
def test_dispatch_statuses(argv, status, capsys):
    assert cli.main(argv) == status
    out, err = capsys.readouterr()
    assert "usage:" in out + err and "Traceback" not in err


def test_exercises_command_old_and_new_spelling(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / "01_demo.py").write_text("x = 1\n### BEGIN SOLUTION\ny = 2\n### END SOLUTION\n")
    for command in (["-m", "minidist.course.exercises"], ["-m", "minidist", "exercises"]):
        done = subprocess.run([sys.executable, *command, "--force", "--root", str(tmp_path)],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "wrote exercises/01_demo.py\n"
        assert "raise NotImplementedError()" in (tmp_path / "exercises" / "01_demo.py").read_text()
        (tmp_path / "exercises" / "01_demo.py").write_text("edited")


def test_no_argparse_outside_cli():
    cli_package = ROOT / "minidist" / "cli"
    offenders = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "minidist").rglob("*.py"))
                 if cli_package not in path.parents and "argparse" in path.read_text()]
    assert offenders == [], f"argument parsing belongs in minidist/cli/: {offenders}"
    assert "argparse" in (cli_package / "train.py").read_text()  # the test looks where the parsing is

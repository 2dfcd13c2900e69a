"""python -m minidist: one parser module; usage errors exit 2 with a message naming the flag,
never a traceback, and never run the command."""
import ast
import re
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


@pytest.mark.parametrize("argv,status", [([], 2), (["-h"], 0), (["frobnicate"], 2), (["train", "-h"], 0),
                                         (["generate", "-h"], 0), (["generate", "--prompt", "a"], 2)])
def test_dispatch_statuses(argv, status, capsys):
    assert cli.main(argv) == status
    out, err = capsys.readouterr()
    assert "usage:" in out + err and "Traceback" not in err


def test_exercises_command_writes_stubs_and_the_old_spelling_is_gone(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / "01_demo.py").write_text("x = 1\n### BEGIN SOLUTION\ny = 2\n### END SOLUTION\n")
    done = subprocess.run([sys.executable, "-m", "minidist", "exercises", "--force", "--root", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "wrote exercises/01_demo.py\n"
    assert "raise NotImplementedError()" in (tmp_path / "exercises" / "01_demo.py").read_text()
    # `python -m minidist.course.exercises` was the old spelling: the module no longer runs as a script
    old = subprocess.run([sys.executable, "-m", "minidist.course.exercises", "--force", "--root", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert old.stdout == "" and "__main__" not in (ROOT / "minidist" / "course" / "exercises.py").read_text()


def test_no_argparse_outside_cli():
    cli_package = ROOT / "minidist" / "cli"
    offenders = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "minidist").rglob("*.py"))
                 if cli_package not in path.parents and "argparse" in path.read_text()]
    assert offenders == [], f"argument parsing belongs in minidist/cli/: {offenders}"
    assert "argparse" in (cli_package / "train.py").read_text()  # the test looks where the parsing is


# ----------------------------------------------------------------------------- the README's commands (issue 18)

BARE = re.compile(r"(?:^|[\s;&|(`])(?<!-m )(python3?|mpiexec|mpirun|pip3?|pytest)(?=\s)")  # not `-m pytest`


def readme_commands():
    """The README's commands: each line of its bash blocks (comments dropped) and each inline
    code span that starts with a program name."""
    text = (ROOT / "README.md").read_text()
    lines = [line.split("  #")[0] for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    spans = [span for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
             if re.match(r"(\.venv/bin/)?(python3?|mpiexec|mpirun|pip3?|pytest)\s", span)]
    return lines + spans


def test_every_readme_command_runs_without_an_activated_venv():
    # before: `python -m minidist launch ...`, `pytest tests/test_cuda.py`, `mpiexec -n 4 python ...` in the prose
    commands = readme_commands()
    assert len(commands) > 30
    # "On a real cluster" starts ranks with the cluster's own mpiexec (its `module load` puts it on the PATH)
    cluster = (ROOT / "README.md").read_text().split("## On a real cluster")[1].split("\n## ")[0]
    system_mpi = {line.split("  #")[0] for line in cluster.splitlines() if re.match(r"\s*mpiexec -f hostfile ", line)}
    bare = [command for command in commands if BARE.search(command) and command not in system_mpi]
    assert bare == [], "give each command its .venv/bin/ path: " + "; ".join(bare)


def test_every_benchmark_usage_line_runs_without_an_activated_venv():
    bare = []
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        bare += [f"{script.name}: {line.strip()}" for line in doc.splitlines()
                 if re.match(r"\s*(python3?|mpiexec|mpirun)\s", line)]
    assert bare == []


def test_each_readme_run_that_checkpoints_has_its_own_folder():
    # before: a single and a ddp run in ckpt/, after which launch retried three times into the mismatch
    folders = {}
    for command in readme_commands():
        found = re.search(r"--checkpoint-dir[ =](\S+)", command)
        strategy = re.search(r"--strategy (\S+)", command)
        if found and found.group(1) != "DIR":
            folders.setdefault(found.group(1), set()).add(strategy.group(1) if strategy else "single")
    assert folders and all(len(strategies) == 1 for strategies in folders.values()), folders


def test_the_readme_launch_example_checkpoints_and_says_how_to_see_a_restart():
    text = (ROOT / "README.md").read_text()
    launches = [c for c in readme_commands() if " launch " in c and " -- train " in c and "--checkpoint-dir" in c]
    assert launches and all("--checkpoint-every" in c for c in launches)
    # how to see a restart: the job's own kill (--kill-at-step), not a pgrep that can pick another user's process
    assert "--kill-at-step 30" in text and "restart 1/3 after exit code" in text and "kill -9" not in text


def test_train_does_not_import_the_notebook_tooling():
    """Every rank of every ``train`` imports minidist.cli; nbformat's import alone took 2.5 s
    (its JSON-schema checks), so only ``check`` and ``exercises`` may pull it in."""
    probe = ("import sys; from minidist import cli; cli.command_function('train'); cli.command_function('generate'); "
             "print(sorted(m for m in ('nbformat', 'nbclient', 'jsonschema') if m in sys.modules)); "
             "cli.command_function('check'); print('nbformat' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "True"], out


def test_a_batch_that_does_not_fit_in_memory_is_one_line_naming_the_flag():
    """Issue 36, item 4: a --batch-size too big for the machine was a MemoryError traceback. With
    the address space capped at 4 GiB (a small machine, and no risk to this one), the GPT's step of
    100,000 windows stops with one line: what NumPy could not allocate and the flag to lower."""
    import resource

    def small_machine():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    done = subprocess.run([sys.executable, "-m", "minidist", "train", "--model", "gpt", "--batch-size", "100000",
                           "--steps", "1", "--no-progress"], capture_output=True, text=True, cwd=ROOT,
                          preexec_fn=small_machine, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.splitlines()
    assert re.fullmatch(r"minidist train: error: out of memory \(unable to allocate [0-9.]+ [GM]iB for an array with "
                        r"shape \(100000, .*\): what one step holds does not fit in this machine's memory; use a "
                        r"smaller --batch-size \(now 100000\)", line), line


def test_out_of_memory_names_the_flag_as_given():
    error = MemoryError("Unable to allocate 8.00 GiB for an array with shape (1024, 1024, 1024)")
    assert cli.out_of_memory("evaluate", ["--batch-size=4096"], error).endswith("use a smaller --batch-size (now 4096)")
    assert cli.out_of_memory("train", [], MemoryError()) == ("out of memory: what one step holds does not fit in this "
                                                             "machine's memory; use a smaller --batch-size")
    assert cli.out_of_memory("plan", [], MemoryError()).startswith("out of memory: close other programs")

"""python -m minidist launch: a failed job is relaunched with --resume and ends as a run never stopped.

The kill is real: train's hidden ``--kill-at-step K`` makes a rank SIGKILL itself at the end of
global step K, once per checkpoint folder (a marker file there), so the relaunch runs past K.
The oracle is an uninterrupted run of the same flags: its saved weights must be equal bit for
bit; and for ``--max-restarts 0`` the exit status of the same killed command run directly.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from minidist import cli, launch
from tests.mpitools import requires_mpi

FLAGS = ["--epochs", "2", "--hidden", "16", "--no-progress", "--checkpoint-every", "5"]


def weights(path) -> dict:
    with np.load(path) as npz:
        return {k: npz[k] for k in npz.files}


def assert_bit_identical(a, b):
    assert sorted(a) == sorted(b) and len(a) == 4
    for key in a:
        assert a[key].tobytes() == b[key].tobytes(), key


def run_direct(command, timeout=180):
    """An attempt run without the supervisor (the oracle)."""
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout).returncode


@requires_mpi
def test_ddp_killed_at_step_7_restarts_once_and_matches_an_uninterrupted_run(tmp_path):
    flags = ["--strategy", "ddp", "--timeout", "60", *FLAGS]
    plain = [*flags, "--checkpoint-dir", str(tmp_path / "a"), "--save-model", str(tmp_path / "a.npz")]
    assert run_direct(launch.train_command(2, plain)) == 0
    lines = []
    killed = [*flags, "--checkpoint-dir", str(tmp_path / "b"), "--save-model", str(tmp_path / "b.npz"),
              "--kill-at-step", "7"]
    assert launch.supervise(2, killed, max_restarts=2, timeout=180, log=lines.append) == 0
    assert len(lines) == 1 and lines[0].startswith("restart 1/2 after exit code ")
    assert (tmp_path / "b" / ".killed-at-7").exists()
    assert_bit_identical(weights(tmp_path / "a.npz"), weights(tmp_path / "b.npz"))

    # --max-restarts 0: the kill's own exit status, as the same command run directly gives it
    again = [*flags, "--checkpoint-dir", str(tmp_path / "c"), "--kill-at-step", "7"]
    direct = run_direct(launch.train_command(2, [*flags, "--checkpoint-dir", str(tmp_path / "d"),
                                                 "--kill-at-step", "7"]))
    lines.clear()
    assert launch.supervise(2, again, max_restarts=0, timeout=180, log=lines.append) == direct != 0
    assert lines == [] and not (tmp_path / "c.npz").exists()


def test_single_without_mpiexec_killed_then_resumed_is_bit_identical(tmp_path, capsys):
    plain = [*FLAGS, "--checkpoint-dir", str(tmp_path / "a"), "--save-model", str(tmp_path / "a.npz")]
    assert cli.main(["train", *plain]) == 0
    killed = [*FLAGS, "--checkpoint-dir", str(tmp_path / "b"), "--save-model", str(tmp_path / "b.npz"),
              "--kill-at-step", "7"]
    assert launch.train_command(1, killed, use_mpiexec=False)[:4] == [sys.executable, "-m", "minidist", "train"]
    assert cli.main(["launch", "-n", "1", "--max-restarts", "1", "--", "train", *killed]) == 0
    assert "restart 1/1 after exit code -9 (killed by SIGKILL): relaunching with --resume" in capsys.readouterr().err
    assert_bit_identical(weights(tmp_path / "a.npz"), weights(tmp_path / "b.npz"))
    # without restarts the command line reports the signal as a shell does: 128 + 9
    again = [*FLAGS, "--checkpoint-dir", str(tmp_path / "c"), "--kill-at-step", "3"]
    assert cli.main(["launch", "--max-restarts", "0", "--", "train", *again]) == 137


FAIL_ONCE = ("import os, sys; m = sys.argv[1]; first = not os.path.exists(m); open(m, 'a').close(); "
             "print('resume' if '--resume' in sys.argv else 'fresh'); sys.exit(int(sys.argv[2]) if first else 0)")


@pytest.mark.parametrize("status", [1, 9, -1])
def test_run_with_restarts_relaunches_a_failed_command_with_the_retry_flags(tmp_path, capfd, status):
    marker = tmp_path / "failed-once"
    code = 3 if status == -1 else status
    first = [sys.executable, "-c", FAIL_ONCE, str(marker), str(code)]
    lines = []
    assert launch.run_with_restarts(first, [*first, "--resume"], 2, timeout=60, log=lines.append) == 0
    assert lines == [f"restart 1/2 after exit code {code}: relaunching with --resume"]
    assert capfd.readouterr().out.split() == ["fresh", "resume"]


def test_out_of_restarts_usage_errors_and_timeouts_end_with_the_last_status(tmp_path):
    lines = []
    fail = [sys.executable, "-c", "import sys; sys.exit(5)"]
    assert launch.run_with_restarts(fail, fail, 2, timeout=60, log=lines.append) == 5
    assert [line.split(" after")[0] for line in lines] == ["restart 1/2", "restart 2/2", "launch: giving up"]
    lines.clear()
    usage = [sys.executable, "-c", "import sys; sys.exit(2)"]
    assert launch.run_with_restarts(usage, usage, 3, timeout=60, log=lines.append) == 2
    assert len(lines) == 1 and "not restarting after exit code 2" in lines[0]
    lines.clear()
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    assert launch.run_with_restarts(hang, hang, 1, timeout=0.5, log=lines.append) == launch.TIMED_OUT
    assert "restart 1/1 after exit code 124 (the job timed out)" in lines[1]


@pytest.mark.parametrize("argv, message", [
    (["--", "train", "--epochs", "1"], "add --checkpoint-dir DIR"),
    (["-n", "2"], "give the job after --"),
    (["--", "evaluate"], "give the job after --"),
    (["-n", "2", "--", "train", "--checkpoint-dir", "x"], "--strategy single trains in one process: use -n 1"),
    (["--max-restarts", "-1", "--", "train", "--checkpoint-dir", "x"], "--max-restarts"),
    (["--", "train", "--strategy", "ps", "--ps-mode", "async", "--checkpoint-dir", "x"], "--ps-mode sync only"),
    # before: launched, and the replay (which writes nothing) was "restarted" with --resume, another usage error
    (["--", "train", "--checkpoint-dir", "x", "--replay-step", "3"], "--replay-step reruns one step"),
])
def test_launch_usage_errors(argv, message, capsys):
    assert cli.main(["launch", *argv]) == 2
    assert message in capsys.readouterr().err


def test_supervise_refuses_flags_without_a_checkpoint_dir():
    with pytest.raises(ValueError, match="--checkpoint-dir"):
        launch.supervise(1, ["--epochs", "1"], use_mpiexec=False)


# ------------------------------------------------------------------ the supervisor ends its job (issue 18)

ROOT = Path(__file__).resolve().parents[1]
LONG = ["--epochs", "200", "--hidden", "16", "--no-progress", "--checkpoint-every", "5"]


def processes_naming(text: str) -> list[int]:
    """Live processes (not zombies) whose command line holds ``text``: a job's unique folder."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if text.encode() in (entry / "cmdline").read_bytes() and \
                    (entry / "stat").read_text().split(")")[-1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def supervise_then_signal(tmp_path, sig, train_flags, nproc=1):
    """Start ``python -m minidist launch -n N -- train FLAGS --checkpoint-dir DIR`` (its own
    session), wait for its first checkpoint, send it ``sig``; return (status, stderr, seconds
    from the signal to its exit, the processes still naming DIR afterwards). Whatever happens,
    every process naming DIR is killed at the end (by pid: they are this test's)."""
    ckpt = tmp_path / "ckpt-signal"
    command = [sys.executable, "-m", "minidist", "launch", "-n", str(nproc), "--max-restarts", "2", "--", "train",
               *train_flags, *LONG, "--checkpoint-dir", str(ckpt)]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not list(ckpt.glob("ckpt-*.npz")) and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None and list(ckpt.glob("ckpt-*.npz")), "the job never checkpointed"
        proc.send_signal(sig)
        sent = time.perf_counter()
        _, err = proc.communicate(timeout=60)
        seconds = time.perf_counter() - sent
        time.sleep(1)
        return proc.returncode, err, seconds, processes_naming(str(ckpt))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in processes_naming(str(ckpt)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@requires_mpi
def test_sigterm_to_launch_ends_mpiexec_and_every_rank(tmp_path):
    # before: the supervisor died at once (status -15) and mpiexec and both ranks trained on, writing checkpoints
    status, err, seconds, left = supervise_then_signal(tmp_path, signal.SIGTERM,
                                                       ["--strategy", "ddp", "--timeout", "60"], nproc=2)
    assert status == 128 + signal.SIGTERM, err
    assert left == [], "processes of the job outlived the supervisor"
    assert seconds < launch.STOP_GRACE + 15
    assert "minidist launch: stopped by SIGTERM; ended the job" in err and "Traceback" not in err


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT])
def test_sighup_and_ctrl_c_end_a_single_job_with_one_line(tmp_path, sig):
    status, err, seconds, left = supervise_then_signal(tmp_path, sig, [])
    assert status == 128 + sig, err
    assert left == []
    assert f"minidist launch: stopped by {signal.Signals(sig).name}; ended the job" in err
    assert "Traceback" not in err


def test_a_checkpoint_folder_of_another_run_is_not_retried(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    assert cli.main(["train", *FLAGS, "--checkpoint-dir", ckpt]) == 0
    lines = []
    status = launch.supervise(1, [*FLAGS, "--lr", "0.1", "--checkpoint-dir", ckpt, "--resume"], max_restarts=2,
                              timeout=120, use_mpiexec=False, log=lines.append)
    assert status == 2  # a usage error: the same flags would fail the same way
    assert lines == ["launch: not restarting after exit code 2, a usage error (it would fail the same way again)"]


def test_a_relaunch_line_starts_a_line_of_its_own_in_a_terminal(monkeypatch):
    """The failed attempt's tqdm bar ends without a newline; in a terminal the supervisor's line
    was glued to it ("steps 1-100/500:  42%|####   relaunching on 3 ranks ..."). In a terminal it
    now starts on a new line; into a pipe or file (notebooks, logs) it is written as before."""
    import io

    from minidist import launch

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, expected in ((Terminal(), "\nrelaunching on 3 ranks\n"), (io.StringIO(), "relaunching on 3 ranks\n")):
        monkeypatch.setattr(sys, "stderr", stream)
        launch.supervisor_log("relaunching on 3 ranks")
        assert stream.getvalue() == expected

"""Test bodies that several test files share (issue 30: written once)."""
from __future__ import annotations

import pytest

from minidist import cli, train


def assert_usage_error(args: list[str], message: str, capsys, monkeypatch, why: str = "a bad flag") -> None:
    """``python -m minidist train ARGS`` (in process) exits 2 with ``message`` on stderr and no
    traceback, and never starts training (loading the data set fails the test)."""
    monkeypatch.setattr(train, "load_dataset", lambda config: pytest.fail(f"training started despite {why}"))
    assert cli.main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err

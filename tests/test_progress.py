"""Progress when stderr is not a terminal: log lines with done/total and rate (policy/progress.py)."""

from __future__ import annotations

import io
import logging

from entropy_experiments.policy.progress import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_logs_done_total_and_rate(caplog):
    with caplog.at_level(logging.INFO, logger="entropy_experiments.progress"):
        out = list(progress(range(5), "E backward", stream=io.StringIO(), every_s=0.0))
    assert out == list(range(5))
    lines = [r.getMessage() for r in caplog.records if r.name == "entropy_experiments.progress"]
    assert lines[0].startswith("E backward: 1/5 (") and lines[-1].startswith("E backward: 5/5 (")
    assert all(line.endswith("/s)") for line in lines)


def test_short_loops_stay_silent_and_terminals_get_a_bar(caplog):
    with caplog.at_level(logging.INFO, logger="entropy_experiments.progress"):
        assert list(progress(iter(range(3)), "quick", stream=io.StringIO())) == [0, 1, 2]
    assert not [r for r in caplog.records if r.name == "entropy_experiments.progress"]
    terminal = _Terminal()
    assert list(progress(range(3), "bar", stream=terminal)) == [0, 1, 2]
    assert "bar" in terminal.getvalue()

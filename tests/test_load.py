"""Load, at reduced counts: fresh-process runs and repeated in-process runs of the tiny probe exit 0 and show
identical numbers, no leaked tensors or hooks and untouched parameters. Memory (peak and resident RSS, with its
growth over the runs) is measured and printed by `bench/load_test.py`, which runs the full 50 / 20, not asserted
here; ENTROPY_LOAD_FRESH and ENTROPY_LOAD_IN_PROCESS raise the counts here."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "load_test.py"


@pytest.fixture(scope="module")
def load_test():
    spec = importlib.util.spec_from_file_location("load_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def config(load_test, tmp_path_factory) -> Path:
    return load_test.make_setup(tmp_path_factory.mktemp("load"))


def _without_rss(problems: list[str]) -> list[str]:
    """The bench's problems less its RSS checks: memory is measured by bench/load_test.py, not asserted here."""
    return [p for p in problems if "RSS grows" not in p]


@pytest.mark.e2e
def test_fresh_processes_give_identical_results(load_test, config, tmp_path):
    records = load_test.fresh_process_runs(config, int(os.environ.get("ENTROPY_LOAD_FRESH", "2")), tmp_path)
    assert len(records) >= 2 and _without_rss(load_test.check_fresh(records)) == []


@pytest.mark.e2e
def test_in_process_runs_leak_nothing(load_test, config):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        records = load_test.in_process_runs(config, int(os.environ.get("ENTROPY_LOAD_IN_PROCESS", "20")))
    finally:
        torch.set_num_threads(n)
    assert len(records) >= 2 and _without_rss(load_test.check_in_process(records)) == []


def test_the_benchs_growth_check_ignores_one_noisy_run(load_test):
    noisy = [300.0, 301.0, 299.0, 350.0, 300.5, 300.0]  # one +50 MB outlier, no trend
    assert not load_test.grows(noisy[:3], noisy[3:], 24.0)
    assert load_test.grows([300.0, 301.0, 299.0], [340.0, 338.0, 342.0], 24.0)  # a real trend

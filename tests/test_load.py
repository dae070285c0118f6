"""Load (issue 6), at reduced counts: fresh-process runs and repeated in-process runs of the tiny probe
show identical numbers and no memory growth. `bench/load_test.py` runs the full 50 / 20;
ENTROPY_LOAD_FRESH and ENTROPY_LOAD_IN_PROCESS raise the counts here."""

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


def test_fresh_processes_give_identical_results_and_flat_peak_memory(load_test, config, tmp_path):
    records = load_test.fresh_process_runs(config, int(os.environ.get("ENTROPY_LOAD_FRESH", "2")), tmp_path)
    assert load_test.check_fresh(records) == []


def test_in_process_runs_leak_nothing(load_test, config):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        records = load_test.in_process_runs(config, int(os.environ.get("ENTROPY_LOAD_IN_PROCESS", "20")))
    finally:
        torch.set_num_threads(n)
    assert load_test.check_in_process(records) == []

"""Session fixtures shared by the test suite: a tiny random Qwen2 saved to disk and loaded back."""

from __future__ import annotations

import os

# Forced, not defaulted: a user's HF_HUB_OFFLINE=0 must not let a test reach the network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from entropy_experiments.testing.tiny_model import add_random_lora, build_tiny_model_dir

# ENTROPY_EXPERIMENTS_CACHE (the converted embedded SmolLM2, demo checkpoints) is one temporary directory
# per test run, never the user's ~/.cache: the controller makes it and names it in _SHARED_CACHE_ENV
# before the xdist workers start (they inherit the environment; a worker that somehow lacks it derives
# the same path from the run's PYTEST_XDIST_TESTRUNUID). Converting SmolLM2 into it costs ~40 s of CPU
# and 0.5 GB of disk once per run (models/embedded.py's file lock: once across workers). To reuse a cache
# between runs, set ENTROPY_TESTS_SHARED_CACHE=/some/dir yourself (never the user's probe cache).
_SHARED_CACHE_ENV = "ENTROPY_TESTS_SHARED_CACHE"
_CACHE_ENV = "ENTROPY_EXPERIMENTS_CACHE"


def _worker_cache_dir() -> Path:
    shared = os.environ.get(_SHARED_CACHE_ENV)
    if shared:
        return Path(shared)
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID", "no-uid")
    path = Path(tempfile.gettempdir()) / f"entropy-tests-cache-{uid}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: use the controller's directory
        os.environ[_CACHE_ENV] = str(_worker_cache_dir())
        return
    preset = os.environ.get(_SHARED_CACHE_ENV)
    if preset:  # a developer's own reusable test cache: kept after the run
        Path(preset).mkdir(parents=True, exist_ok=True)
        path = preset
    else:
        path = tempfile.mkdtemp(prefix="entropy-tests-cache-")
        config._entropy_tests_cache = path  # removed in pytest_unconfigure
    os.environ[_SHARED_CACHE_ENV] = path
    os.environ[_CACHE_ENV] = path


def pytest_unconfigure(config):
    path = getattr(config, "_entropy_tests_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path of a directory holding the tiny Qwen2 and its tokenizer (HF layout)."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_qwen2"))


def _load_tiny(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer(tiny_model_dir):
    """(model, tokenizer): the tiny Qwen2 in fp32 eval mode. Treat as read-only."""
    return _load_tiny(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_peft_model_and_tokenizer(tiny_model_dir):
    """(peft_model, tokenizer): a fresh copy of the tiny model under a LoRA r=4 with random lora_B."""
    model, tokenizer = _load_tiny(tiny_model_dir)
    return add_random_lora(model), tokenizer


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch limited to one intra-op thread for a module (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

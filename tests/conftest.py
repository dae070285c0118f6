"""Session fixtures shared by the test suite: a tiny random Qwen2 saved to disk and loaded back."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from entropy_experiments.testing.tiny_model import add_random_lora, build_tiny_model_dir


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

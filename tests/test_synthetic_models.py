"""Models of real architectures built in code (models/synthetic.py) and make-checkpoint --synthetic.

The real sizes are checked by parameter count on the meta device against the published counts (exact sums
of the published config.json shapes); everything that runs uses the same builder at a toy width and depth,
with the real vocabulary size.
"""

from __future__ import annotations

import json

import pytest
import torch

from entropy_experiments import cli
from entropy_experiments.checkpoint.load import load_for_probe
from entropy_experiments.config import config_from_dict
from entropy_experiments.errors import ConfigError
from entropy_experiments.make_checkpoint import synthetic as synthetic_checkpoint
from entropy_experiments.models.synthetic import (
    SYNTHETIC_SPECS,
    build_synthetic_model_dir,
    build_synthetic_tokenizer,
    parameter_count,
    spec_named,
)
from tests.probe_helpers import SHORT_PROMPTS, write_prompts
from tests.run_helpers import logging_restored

QWEN_VOCAB = 151_936


@pytest.mark.parametrize("name", sorted(SYNTHETIC_SPECS))
def test_real_sizes_match_the_published_parameter_counts(name):
    spec = SYNTHETIC_SPECS[name]
    assert parameter_count(spec) == spec.published_parameters


def test_published_numbers_reach_the_hf_config():
    from entropy_experiments.models.synthetic import hf_config

    config = hf_config(spec_named("Qwen2.5-1.5B"), eos_token_id=7)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (QWEN_VOCAB, 1536, 28)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (12, 2, 8960)
    assert config.rope_parameters["rope_theta"] == 1_000_000.0 and config.tie_word_embeddings


def test_unknown_name_is_one_line():
    with pytest.raises(ConfigError, match="qwen2.5-1.5b"):
        spec_named("qwen2.5-1.6b")


def test_tokenizer_has_the_real_vocabulary_and_encodes_prompts_with_real_merges():
    tok = build_synthetic_tokenizer(QWEN_VOCAB)
    assert len(tok) == QWEN_VOCAB
    text = "What is 2 + 2? <answer>4</answer>"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text) // 2  # merges apply, fillers do not
    assert max(tok.convert_tokens_to_ids(tok.convert_ids_to_tokens([QWEN_VOCAB - 1]))) == QWEN_VOCAB - 1
    assert isinstance(tok.decode([QWEN_VOCAB - 1, 100_000]), str)  # sampled fillers decode


@pytest.fixture(scope="module")
def scaled_qwen_dir(tmp_path_factory):
    spec = spec_named("qwen2.5-0.5b").scaled(hidden_size=32, intermediate_size=64)
    return build_synthetic_model_dir(spec, tmp_path_factory.mktemp("scaled") / "synthetic_base")


def test_scaled_model_loads_back_like_a_downloaded_checkpoint(scaled_qwen_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(scaled_qwen_dir)
    tok = AutoTokenizer.from_pretrained(scaled_qwen_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.bfloat16
    assert model.config.vocab_size == len(tok) == QWEN_VOCAB
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied as published
    with torch.no_grad():
        logits = model(**tok(["2 + 2 ="], return_tensors="pt")).logits.float()
    entropy = -(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1)
    assert float(entropy.min()) > 0.9 * float(torch.log(torch.tensor(QWEN_VOCAB)))  # near-uniform: worst case


@pytest.mark.e2e
def test_make_checkpoint_synthetic_gives_a_checkpoint_the_probe_loads(tmp_path, scaled_qwen_dir, monkeypatch):
    """The CLI path end to end on the scaled spec: base built in OUT/synthetic_base, a real AdamW step."""
    scaled = spec_named("qwen2.5-0.5b").scaled(hidden_size=32, intermediate_size=64)
    monkeypatch.setattr(synthetic_checkpoint, "spec_named", lambda name: scaled)
    data = write_prompts(tmp_path / "prompts.jsonl", SHORT_PROMPTS)
    out = tmp_path / "ckpt"
    args = ["make-checkpoint", "--synthetic", "qwen2.5-0.5b", "--out", str(out), "--steps", "1",
            "--set", "checkpoint.device_map=cpu", "--set", "batch_config.dataset_name=jsonl",
            "--set", f"batch_config.dataset_path={data}", "--set", "batch_config.B_U=2",
            "--set", "batch_config.G=4", "--set", "generation.max_new_tokens=8"]
    with logging_restored():
        assert cli.main(args) == 0
    assert (out / "synthetic_base" / "SYNTHETIC.txt").is_file()
    recorded = json.loads((out / "model" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str((out / "synthetic_base").resolve())
    config = config_from_dict({"checkpoint": {"checkpoint_path": str(out), "device_map": "cpu"}})
    loaded = load_for_probe(config.checkpoint, None)
    state = loaded.optimizer.state_dict()["state"]
    assert state and all(float(s["step"]) == 1.0 for s in state.values())
    assert any(float(s["exp_avg"].abs().max()) > 0 for s in state.values())  # a real, non-zero step
    assert len(loaded.tokenizer) == QWEN_VOCAB

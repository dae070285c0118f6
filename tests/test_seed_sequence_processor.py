"""The seed API's SequenceProcessor (seed 004; import paths `entropy_experiments.utils.sequence_processor` and
`sequence_processing.sequence_processor`): its config forms, private names, prompt draws, rewards and the
generate-score-reward calls, on the tiny Qwen2 with a LoRA adapter."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from entropy_experiments.errors import DataError
from entropy_experiments.policy.engine import PolicyEngine
from entropy_experiments.policy.generation_config import parse_settings
from entropy_experiments.utils.sequence_processor import SequenceProcessor

# One intra-op thread for the whole module (runs here are compared number for number).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEED_004_CONFIG = {  # the dict config of seed 004's usage example
    "generation": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 6, "gen_batch_size": 16, "tf_batch_size": 8},
    "precision": {"func_override": {"autocast": False, "dtype": "float32", "cast_params": True},
                  "tf_nograd": {"autocast": False, "dtype": "float32", "cast_logits_fp32": True},
                  "allow_tf32": False, "matmul_precision": "high", "entropy_fp64": False},
}


def test_both_import_paths_are_one_implementation():
    import entropy_experiments.utils.sequence_processor as real
    import sequence_processing.sequence_processor as shim

    assert shim.SequenceProcessor is real.SequenceProcessor
    assert shim.GenerationConfig is real.GenerationConfig and shim.BatchedSequences is real.BatchedSequences


def test_seed_004_usage_example_scores_as_the_policy_engine(tiny_peft_model_and_tokenizer):
    """Seed 004's example: a dict config, generate, then score θ + η·v through `_build_params_override`;
    the seed's names (`_fo_cfg`, `_tf_cfg`, `_mdl_target`, `entropies`) are the engine's values."""
    model, tok = tiny_peft_model_and_tokenizer
    sp = SequenceProcessor(model, tok, logger=None, config=SEED_004_CONFIG)
    engine = PolicyEngine(model, tok, parse_settings(SEED_004_CONFIG))
    assert sp._fo_cfg == engine.precision.func_override and sp._tf_cfg == engine.precision.tf_nograd
    assert sp._mdl_target is engine.policy.module and sp.config == engine.config
    seqs = sp.generate_batched(["What is 2 + 2?", "Hi"], G=2, seed=0)
    g = torch.Generator().manual_seed(0)
    v = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters() if p.requires_grad}
    lp = sp.teacher_force_logprobs(seqs, compute_rb=True, params_override=sp._build_params_override(v, 1e-3))
    ref = engine.teacher_force_logprobs(seqs, compute_rb=True, params_override=engine.build_params_override(v, 1e-3))
    for b in range(2):
        for k in range(2):
            assert torch.equal(lp.token_logqs[b][k], ref.token_logqs[b][k])
            assert (lp.rb_entropies[b][k] == ref.rb_entropies[b][k]).all()
    assert lp.entropies is lp.surprisals  # the seed API's name for −log q per token


def test_sample_prompts_uses_a_local_rng(tiny_peft_model_and_tokenizer, tmp_path):
    model, tok = tiny_peft_model_and_tokenizer
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": f"Q{i}?", "answer": str(i)}) + "\n" for i in range(10)))
    sp = SequenceProcessor(model, tok, {"generation": {}, "batch_config": {"dataset_path": str(path)}})
    py_state = random.getstate()
    prompts, examples = sp.sample_prompts("jsonl", "train", 4, seed=3)
    assert random.getstate() == py_state
    assert (prompts, examples) == sp.sample_prompts("jsonl", "train", 4, seed=3)
    assert len(set(prompts)) == 4 and [ex.question for ex in examples] == prompts
    with pytest.raises(DataError, match="11 distinct prompts"):
        sp.sample_prompts("jsonl", "train", 11, seed=0)


@pytest.fixture()
def qa_file(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(3)))
    return path


@pytest.fixture()
def rigged_reward(monkeypatch):
    """A reward that returns the gold answer as a number: non-zero only if gold answers arrive."""
    from entropy_experiments.data.rewards import REWARD_REGISTRY

    monkeypatch.setitem(REWARD_REGISTRY, "rigged_gold_number",
                        lambda prompt, responses, example: [float(example.answer)] * len(responses))
    return "rigged_gold_number"


def _sp_with_data(tiny_peft_model_and_tokenizer, qa_file, reward):
    model, tok = tiny_peft_model_and_tokenizer
    return SequenceProcessor(model, tok, {"generation": {"max_new_tokens": 6, "gen_batch_size": 4},
                                          "reward": {"name": reward}, "batch_config": {"dataset_path": str(qa_file)}})


def test_replacement_sampling_keeps_gold_answers_and_counts(tiny_peft_model_and_tokenizer, qa_file, rigged_reward, caplog):
    sp = _sp_with_data(tiny_peft_model_and_tokenizer, qa_file, rigged_reward)
    with caplog.at_level(logging.INFO):
        seqs, lp, diags = sp.generate_with_replacement_sampling(7, "jsonl", seed=0, G=4, compute_rb=True)
    assert seqs.sequences.shape[:2] == (7, 1) and len(lp.rewards) == 7 and len(diags.diagnostics) == 7
    for b in range(7):
        example = seqs.examples[b]
        assert seqs.prompts[b] == example.question and seqs.prompt_ids[b] == example.meta["global_prompt_id"]
        assert lp.rewards[b] == [float(example.answer)] and lp.rewards[b][0] > 0
    unique = len(set(seqs.prompts))
    assert f"pool 3 prompts, 7 draws, {unique} unique, largest repeat" in caplog.text
    assert "G=4 ignored, forced to 1" in caplog.text
    assert len(lp.rb_entropies[0][0]) == seqs.gen_lens[0][0]


def test_generate_with_logprobs_from_a_data_set_and_explicit_examples(tiny_peft_model_and_tokenizer, qa_file,
                                                                      rigged_reward):
    sp = _sp_with_data(tiny_peft_model_and_tokenizer, qa_file, rigged_reward)
    seqs, lp, diags = sp.generate_with_logprobs(dataset_name="jsonl", num_prompts=2, G=2, seed=1)
    assert seqs.sequences.shape[:2] == (2, 2)
    assert [r[0] for r in lp.rewards] == [float(ex.answer) for ex in seqs.examples]
    assert diags.diagnostics[1][1].seq.T == seqs.gen_lens[1][1]
    prompts, examples = sp.sample_prompts("jsonl", "train", 2, seed=5)
    _, lp2, _ = sp.generate_with_logprobs(prompts=prompts, examples=examples, G=1, seed=2)
    assert [r[0] for r in lp2.rewards] == [float(ex.answer) for ex in examples]


def test_missing_examples_give_zero_rewards_with_one_warning(tiny_peft_model_and_tokenizer, qa_file, rigged_reward,
                                                             caplog):
    sp = _sp_with_data(tiny_peft_model_and_tokenizer, qa_file, rigged_reward)
    with caplog.at_level(logging.WARNING):
        _, lp, _ = sp.generate_with_logprobs(prompts=["a", "b"], G=1, seed=0)
        sp.generate_with_logprobs(prompts=["c"], G=1, seed=0)
    assert lp.rewards == [[0.0], [0.0]]
    assert caplog.text.count("no data-set example") == 1

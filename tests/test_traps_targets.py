"""Tests written for the trap suite (scripts/traps.py): docs/maths.md §8 traps no other test noticed.

- gradients for v taken in train() mode: the tiny models have dropout 0, so train() and eval() give
  the same numbers there; here the attention dropout is switched on, the caller leaves the model in
  train(), and the U gradient must still equal the gradient with dropout off (and be reproducible);
- rewards silently zero: the probe's batch sampler must hand each prompt's own data-set example
  (gold answer) to the reward, for prompts drawn with replacement (repeats included).
"""

from __future__ import annotations

import json

import pytest
import torch

from entropy_experiments.data.datasets import load_examples
from entropy_experiments.data.rewards.weighted import RewardSet
from entropy_experiments.policy.engine import PolicyEngine
from entropy_experiments.policy.generation_config import parse_settings
from entropy_experiments.probe import recipe
from entropy_experiments.probe.sampling import BatchDraw, SamplingSpec, sample_batch
from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts


def _set_attention_dropout(model, p: float) -> int:
    count = 0
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = p
            count += 1
    return count


def test_u_gradient_is_taken_in_eval_mode_even_with_dropout(tiny_model_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", SHORT_PROMPTS)
    probe = make_probe(tiny_model_dir, prompts, {"batch_config": {"B_U": 4, "G": 3}})
    _, U = probe.sample(B_E=1, B_U=4, G=3)[:2]
    all_prompts = [list(range(U.num_prompts))]

    assert _set_attention_dropout(probe.model, 0.0) > 0
    reference = recipe.update_gradients(probe.config, probe.policy, U, all_prompts).total  # dropout off: train() and eval() coincide
    assert max(g.abs().max().item() for g in reference.values()) > 0, "the test batch must give a gradient"

    _set_attention_dropout(probe.model, 0.5)
    for _ in range(2):
        probe.model.train()  # a caller (or a trainer's leftover state) left dropout on
        got = recipe.update_gradients(probe.config, probe.policy, U, all_prompts).total
        assert not probe.model.training, "the U backward must run in eval() mode"
        for name, ref in reference.items():
            assert torch.allclose(got[name], ref, rtol=1e-5, atol=1e-7 * ref.abs().max().item()), name


@pytest.fixture()
def gold_reward(monkeypatch):
    """A reward equal to the prompt's gold answer: non-zero only if gold answers arrive."""
    from entropy_experiments.data.rewards import REWARD_REGISTRY

    monkeypatch.setitem(REWARD_REGISTRY, "trap_gold_number",
                        lambda prompt, responses, example: [float(example.answer)] * len(responses))
    return "trap_gold_number"


def test_probe_batches_pass_each_prompts_gold_answer_to_the_reward(tiny_peft_model_and_tokenizer, tmp_path,
                                                                   gold_reward):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(3)))
    model, tok = tiny_peft_model_and_tokenizer
    engine = PolicyEngine(model, tok, parse_settings({"generation": {"max_new_tokens": 3, "gen_batch_size": 8}}))
    examples = load_examples("jsonl", "train", dataset_path=str(path))
    indices = [2, 0, 2, 1]  # drawn with replacement: a repeat, out of order
    batch = sample_batch(SamplingSpec.choose(engine), examples, BatchDraw(indices, 2, 0, RewardSet.resolve([gold_reward])))
    want = [[float(examples[i].answer)] * 2 for i in indices]
    assert want == [[3.0, 3.0], [1.0, 1.0], [3.0, 3.0], [2.0, 2.0]]
    assert [list(map(float, row)) for row in batch.rewards] == want


def test_a_bf16_checkpoint_runs_in_fp32(tiny_model_dir, tmp_path):
    """checkpoint.dtype: bf16 stores the base in bf16, but the probe must compute in fp32 (docs/maths.md §7):
    a bf16 runtime quantises the log-prob changes of θ + η·v away (ΔH flat in η)."""
    from entropy_experiments.config import config_from_dict
    from entropy_experiments.probe.parallel import SINGLE
    from entropy_experiments.probe.results import WarningLog
    from tests.run_helpers import make_run_setup

    _, config = make_run_setup(tmp_path / "setup", tiny_model_dir)
    config["checkpoint"]["dtype"] = "bf16"
    model = recipe.load_phase(config_from_dict(config), SINGLE, WarningLog(recipe.log)).trainable.model
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.float32}, dtypes
    assert not model.training

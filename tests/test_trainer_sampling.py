"""The trainer's sampling and batch: generation presets, the U size vs the trainer's step, the index plan."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from entropy_experiments.checkpoint.trainer_batch import trainer_batch_record
from entropy_experiments.config import config_from_dict
from entropy_experiments.data.plan import draw_index_plan


@pytest.mark.parametrize("trainer", ["trl", "verl", "openrlhf"])
def test_trainer_preset_samples_as_the_trainer(trainer):
    cfg = config_from_dict({"objective": {"trainer": trainer}})
    assert cfg.generation.stop_strings == [] and cfg.generation.temperature == 1.0 and cfg.generation.top_p == 1.0
    assert config_from_dict(cfg.to_dict()) == cfg  # config.yaml holds the resolved values
    assert not cfg.objective_warnings("trainer")
    given = config_from_dict({"objective": {"trainer": trainer},
                              "generation": {"stop_strings": ["</answer>"], "temperature": 0.7}})
    assert given.generation.stop_strings == ["</answer>"] and given.generation.temperature == 0.7
    assert any("stops at EOS only" in w for w in given.objective_warnings("trainer"))
    assert config_from_dict({}).generation.stop_strings == ["</answer>"]  # no trainer: the probe's own default


def test_u_size_against_the_trainers_step(tmp_path):
    record, warning = trainer_batch_record(16, None, B_U=4, G=4)
    assert warning is None and record["trainer_step_completions"] == 16
    record, warning = trainer_batch_record(64, None, B_U=4, G=4)
    assert "B_U×G = 16" in warning and "64" in warning
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"train_batch_size": 32, "global_step": 1}))
    record, warning = trainer_batch_record(None, state, B_U=2, G=4)
    assert record["trainer_state_train_batch_size"] == 32 and "at least 32" in warning
    assert trainer_batch_record(None, state, B_U=8, G=4)[1] is None  # 32 per device could be the whole step
    assert config_from_dict({"objective": {"trainer_batch_completions": 16}}).objective_options()  # not an objective key


def test_index_plan_draws_E_with_replacement_and_U_distinct():
    pool, B_E, B_U = 12, 400, 12
    plan = draw_index_plan(pool, B_E=B_E, B_U=B_U, G=4, E_sampling_mode="replacement", seed=3)
    E, U = plan.E_prompt_indices, plan.U_prompt_indices
    assert len(U) == B_U and len(set(U)) == B_U and set(U) <= set(range(pool))  # U: distinct (here the whole pool)
    counts = Counter(E)
    assert len(E) == B_E and set(counts) == set(range(pool))  # E: every prompt drawn ...
    assert max(counts.values()) > 1 and plan.E_responses_per_prompt == 1  # ... many times (with replacement), G = 1
    # independent uniform draws: two E draws coincide with probability 1/pool (0 for draws without replacement)
    same = sum(p.E_prompt_indices[0] == p.E_prompt_indices[1] for p in (
        draw_index_plan(pool, B_E=2, B_U=1, G=2, E_sampling_mode="replacement", seed=s) for s in range(3000)))
    assert abs(same / 3000 - 1 / pool) < 4 * (1 / pool * (1 - 1 / pool) / 3000) ** 0.5
    distinct = draw_index_plan(pool, B_E=pool, B_U=3, G=4, E_sampling_mode="distinct", seed=3)
    assert sorted(distinct.E_prompt_indices) == list(range(pool)) and distinct.E_responses_per_prompt == 4
    assert draw_index_plan(pool, B_E=B_E, B_U=B_U, G=4, E_sampling_mode="replacement", seed=3) == plan  # seeded

"""make-checkpoint says so when a step had nothing to learn from (every advantage zero)."""

from __future__ import annotations

import logging

from entropy_experiments.config import config_from_dict
from entropy_experiments.make_checkpoint.trained import make_checkpoint
from tests.probe_helpers import SHORT_PROMPTS, write_prompts
from tests.run_helpers import base_config


def test_a_step_with_only_zero_advantages_is_a_warning(tmp_path, tiny_model_dir, caplog):
    data = write_prompts(tmp_path / "prompts.jsonl", SHORT_PROMPTS)
    config = base_config(tiny_model_dir, data, reward={"name": "tests.probe_rewards:constant"})
    with caplog.at_level(logging.INFO, logger="entropy_experiments"):
        make_checkpoint(tmp_path / "ckpt", config_from_dict(config), steps=1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("every U prompt has all-zero advantages" in m for m in warnings), warnings


def test_a_step_with_signal_is_not(tmp_path, tiny_model_dir, caplog):
    data = write_prompts(tmp_path / "prompts.jsonl", SHORT_PROMPTS)
    config = base_config(tiny_model_dir, data)
    with caplog.at_level(logging.INFO, logger="entropy_experiments"):
        make_checkpoint(tmp_path / "ckpt", config_from_dict(config), steps=1)
    assert not [r for r in caplog.records if "all-zero advantages" in r.getMessage() and r.levelno >= logging.WARNING]

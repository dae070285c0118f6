"""Fail in seconds, not minutes: everything about the data and the rewards checked before the model loads.

`preflight(config, tokenizer=None)` loads the prompt pool (the file parses, the columns exist, every row's
prompt is a string or role/content messages, the split is not empty), resolves every reward function and
checks that the probe can call it with the data set's columns, and — for conversational prompts — that the
tokenizer the probe will use (the checkpoint's own when it holds one, else the base model's; tokenizers load
in well under a second) has a chat template and renders the first prompt. Each failure is one ProbeError line.
"""

from __future__ import annotations

import logging
from typing import Any

from ..checkpoint.load import locate_checkpoint
from ..checkpoint.tokenizer_source import load_checkpoint_tokenizer
from ..config import ProbeConfig
from ..data.prompt_rendering import check_chat_template, render_prompt
from ..data.rewards.weighted import RewardSet
from .sampling import prompt_examples

log = logging.getLogger("entropy_experiments.probe")


def checked_tokenizer(config: ProbeConfig, logger: logging.Logger = log) -> tuple[Any, str]:
    """The tokenizer the probe will load (without the model) and where it comes from."""
    files, base = locate_checkpoint(config.checkpoint, logger)
    tokenizer, entry = load_checkpoint_tokenizer(files.tokenizer_dir, base,
                                                 trust_remote_code=config.checkpoint.trust_remote_code)
    return tokenizer, entry["source"]


def pool_warning(examples: list, pool_size: int) -> str | None:
    """A warning when `batch_config.pool_size` keeps only the first rows of a larger `hf` split."""
    rows = (getattr(examples[0], "meta", None) or {}).get("rows_in_split")
    if rows is None or rows <= len(examples):
        return None
    return (f"batch_config.pool_size={pool_size} keeps the first {len(examples)} of the split's {rows} rows, but "
            f"the trainer sampled from all of them: leave batch_config.pool_size null (the whole split) to draw from "
            "the same prompts")


def preflight(config: ProbeConfig, tokenizer: Any = None, logger: logging.Logger = log) -> list[str]:
    """Check the data set, the reward functions and (conversational prompts) the chat template; returns warnings
    for results.json.

    `tokenizer`: the one already loaded (a policy passed in); None loads the one the probe will use."""
    bc = config.batch_config
    examples = prompt_examples(bc)
    rewards = RewardSet.resolve(config.reward.specs(), config.reward.weights, examples[0])
    conversational = isinstance(getattr(examples[0], "prompt", None), list)
    if conversational:
        source = "the loaded policy"
        if tokenizer is None:
            tokenizer, source = checked_tokenizer(config, logger)
        check_chat_template(tokenizer, examples[:1], source)
        render_prompt(tokenizer, examples[0], bc.chat_template_kwargs, where=" of row 0")
    logger.info("preflight: %d %s prompts in %s/%s; rewards %s", len(examples),
                "conversational" if conversational else "standard", bc.dataset_name, bc.split,
                ", ".join(f"{n}×{w:g}" for n, w in zip(rewards.names, rewards.weights, strict=True)))
    warning = pool_warning(examples, bc.pool_size)
    return [warning] if warning else []

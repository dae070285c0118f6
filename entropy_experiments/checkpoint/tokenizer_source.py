"""Which tokenizer (and chat template) the probe uses: the checkpoint's own when it holds one, else the base model's.

TRL and the Hugging Face Trainer save the tokenizer — with its chat template (`chat_template.jinja` or the
`chat_template` entry of tokenizer_config.json) — into every `checkpoint-N/`. A trainer that changed the
template (or added tokens) rendered its prompts with that copy, so the probe prefers it. results.json
records which one was used (`checkpoint.tokenizer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base_model import BaseModelChoice, load_tokenizer

TOKENIZER_MARKER = "tokenizer_config.json"


@dataclass(frozen=True)
class TokenizerChoice:
    """Where the tokenizer comes from: `path` (a directory or base-model id) and `source` ('checkpoint' | 'base_model')."""

    path: str
    source: str


def choose_tokenizer(adapter_dir: Path | None, base: BaseModelChoice) -> TokenizerChoice:
    """The checkpoint directory when it holds tokenizer files (tokenizer_config.json), else the base model."""
    if adapter_dir is not None and (Path(adapter_dir) / TOKENIZER_MARKER).is_file():
        return TokenizerChoice(str(adapter_dir), "checkpoint")
    return TokenizerChoice(base.name, "base_model")


def load_chosen_tokenizer(choice: TokenizerChoice, *, trust_remote_code: bool = False) -> Any:
    return load_tokenizer(choice.path, trust_remote_code=trust_remote_code)


def load_checkpoint_tokenizer(directory: Path | None, base: BaseModelChoice, *,
                              trust_remote_code: bool = False) -> tuple[Any, dict[str, Any]]:
    """The tokenizer of `directory` when it holds one, else the base model's, and its results.json entry."""
    choice = choose_tokenizer(directory, base)
    tokenizer = load_chosen_tokenizer(choice, trust_remote_code=trust_remote_code)
    return tokenizer, tokenizer_info(choice, tokenizer)


def tokenizer_info(choice: TokenizerChoice, tokenizer: Any) -> dict[str, Any]:
    """The `checkpoint.tokenizer` entry of results.json."""
    return {"source": choice.source, "path": choice.path,
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "adds_bos": bool(getattr(tokenizer, "add_bos_token", False))}

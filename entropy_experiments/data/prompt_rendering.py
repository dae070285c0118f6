"""Prompts rendered and tokenised exactly as TRL 1.16's `GRPOTrainer._tokenize_prompts` does.

- conversational (`prompt` is a list of {role, content} messages):
  `tokenizer.apply_chat_template(conversation=..., add_generation_prompt=True, tokenize=True, return_dict=True,
  tools=None, chat_template=None, **chat_template_kwargs)` — the template writes any BOS; no special tokens
  are added on top (transformers tokenises the rendered text with add_special_tokens=False);
- standard (`prompt` a string, and the built-in pools' `question`): `tokenizer(text=prompt)["input_ids"]` —
  special tokens added as the tokenizer does (a BOS for a tokenizer that adds one).

TRL 1.16 has no `max_prompt_length` (prompts are not truncated); the probe's own limit
(`generation.max_prompt_tokens`, the model's context) still applies in the policy. The rendered text (what
`tokenizer.decode` of the ids gives back, special tokens included) is kept for the run directory; the policy
generates from the token ids, so it needs to know nothing about data sets or chat templates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from entropy_experiments.errors import DataError


@dataclass(frozen=True)
class RenderedPrompt:
    """One prompt as the trainer fed it to the model: its text and its token ids."""

    text: str
    token_ids: tuple[int, ...]


def prompt_of(example: Any) -> Any:
    """TRL's `prompt` of an Example: its `prompt` (string or messages), else its `question` (built-in pools)."""
    prompt = getattr(example, "prompt", None)
    return example.question if prompt is None else prompt


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def check_chat_template(tokenizer: Any, examples: Sequence[Any], source: str) -> None:
    """A conversational data set needs a tokenizer with a chat template (else DataError naming both)."""
    if any(isinstance(prompt_of(ex), list) for ex in examples) and not has_chat_template(tokenizer):
        name = getattr(tokenizer, "name_or_path", "?")
        raise DataError(f"the data set's prompts are conversational (lists of messages) but the tokenizer "
                        f"({source}: {name}) has no chat template; save the trainer's tokenizer with the "
                        "checkpoint or use a base model whose tokenizer has one")


def _chat_ids(tokenizer: Any, messages: list, kwargs: Mapping[str, Any]) -> list[int]:
    out = tokenizer.apply_chat_template(conversation=[messages], tools=None, chat_template=None,
                                        add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs)
    return [int(t) for t in out["input_ids"][0]]


def render_prompt(tokenizer: Any, example: Any, chat_template_kwargs: Mapping[str, Any] | None = None,
                  where: str = "") -> RenderedPrompt:
    """The trainer's text and token ids of one example (see the module docstring)."""
    prompt, kwargs = prompt_of(example), dict(chat_template_kwargs or {})
    try:
        if isinstance(prompt, list):
            ids = _chat_ids(tokenizer, prompt, kwargs)
            text = tokenizer.apply_chat_template(prompt, tools=None, chat_template=None, add_generation_prompt=True,
                                                 tokenize=False, **kwargs)
        else:
            ids, text = [int(t) for t in tokenizer(text=prompt)["input_ids"]], prompt
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001  a template that fails on this row: one line naming it
        lines = str(exc).strip().splitlines()
        raise DataError(f"rendering the prompt{where} failed: {type(exc).__name__}: "
                        f"{lines[0] if lines else ''}") from None
    if not ids:
        raise DataError(f"the prompt{where} renders to no tokens")
    return RenderedPrompt(text=str(text), token_ids=tuple(ids))


def render_prompts(tokenizer: Any, examples: Sequence[Any],
                   chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RenderedPrompt]:
    """`render_prompt` of each example (errors name the example's prompt id)."""
    out = []
    for b, example in enumerate(examples):
        meta = getattr(example, "meta", None) or {}
        out.append(render_prompt(tokenizer, example, chat_template_kwargs,
                                 where=f" of prompt id {meta.get('global_prompt_id', b)}"))
    return out

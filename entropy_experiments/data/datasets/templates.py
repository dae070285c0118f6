"""Prompt templates shared by data sets."""

from __future__ import annotations

# The R1-style template used by the historic GSM8K runs. The prompt ends inside an opened <think>,
# so a sampled response reads "... </think> <answer>18</answer>" (what `tag_pref` parses).
R1_TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the user "
    "with the answer. The reasoning process and answer are enclosed within <think> </think> and "
    "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
    "<answer> answer here </answer>.\n"
    "User: {problem}\n"
    "Show your work in <think> </think> tags. And return the final answer in <answer> </answer> tags.\n"
    "Assistant: Let me solve this step by step.\n"
    "Response: <think>"
)


def r1_prompt(problem: str) -> str:
    """Wrap a raw problem in the R1 template; the result ends with 'Response: <think>'."""
    # str.format parses only the template, so braces inside `problem` are safe.
    return R1_TEMPLATE.format(problem=problem.strip())

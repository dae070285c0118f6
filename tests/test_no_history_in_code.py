"""Comments and docstrings of entropy_experiments/ say why the code is as it is, not what it used to be.

What changed and when belongs to CHANGELOG.md; a comment that tells the code's history ("hashed as before",
"the default before finite_difference", a date) leaves the reader to reconstruct the reason. Read: every comment
(consecutive comment lines as one block, so that a phrase may run over a line break) and every module, class and
function docstring of the package's Python files. Flagged: a date, and phrasing that only history explains
(HISTORY below). Order in time as such is no history: "before the step", "before the softmax", "the old sequences"
(those of the policy before the update), "the earlier steps" are not flagged. Strings that are messages are not
read: "the saved run's value ..., now ..." is what a user is told.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "entropy_experiments"

# Subjects whose former state only the history of the code explains ("the old name", "the earlier behaviour").
FORMER_SUBJECTS = (r"code|default|defaults|behaviou?r|names?|spellings?|keys?|versions?|values?|format|layout|"
                   r"implementation|method|hash|api|numbering")
HISTORY = {
    "a date": r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b",
    "used to be": r"\bused to be\b|\b(?:we|it|this|that|they|which) used to\b",
    "previously / formerly": r"\b(?:previously|formerly|hitherto)\b",
    "no longer / any more": r"\bno longer\b|\bnot\b[\w\s]{0,30}\bany ?more\b",
    "as before": r"\bas (?:it (?:was|did) )?before\b(?! (?:the|a|an|any|each|every|it|its|their)\b)|"
                 r"\bas (?:it|they) (?:was|were) before\b|\bas before the (?:split|move|rename|change|rewrite)\b",
    "was the default": r"\b(?:was|were) the defaults?\b|\bthe defaults? before\b",
    "before / until a change": r"\b(?:before|until|since)\b[\w\s'`:]{0,40}?\b(?:existed|rename[ds]?|renaming|"
                               r"refactor\w*|rewrite|rewritten|was added|were added|this change|that change)\b",
    "the old / earlier / previous one": rf"\b(?:the|its|their|an?) (?:old|earlier|previous|former) "
                                        rf"(?:{FORMER_SUBJECTS})\b",
    "was renamed / removed": r"\b(?:was|were|been) (?:renamed|removed|dropped|replaced|deprecated)\b",
    "now means": r"\bnow (?:means|mean|uses|use|does|returns|reads|defaults)\b",
}
PATTERN = re.compile("|".join(f"(?P<g{i}>{p})" for i, p in enumerate(HISTORY.values())), re.IGNORECASE)
KINDS = list(HISTORY)


def history_phrases(text: str) -> list[tuple[str, str]]:
    """(kind, the phrase) for each piece of history phrasing in `text` (line breaks read as spaces)."""
    flat = " ".join(text.split())
    return [(KINDS[int(m.lastgroup[1:])], m.group(0)) for m in PATTERN.finditer(flat)]


def comment_blocks(source: str) -> list[tuple[int, str]]:
    """(first line, text) of each run of comments on consecutive lines, without their '#'."""
    blocks: list[tuple[int, list[str]]] = []
    last = -2
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line, text = tok.start[0], tok.string.lstrip("#").strip()
        if line == last + 1 and blocks:
            blocks[-1][1].append(text)
        else:
            blocks.append((line, [text]))
        last = line
    return [(line, " ".join(texts)) for line, texts in blocks]


def docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of the module's, each class's and each function's docstring."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno, doc))
    return out


def problems_in(path: Path) -> list[str]:
    source = path.read_text(encoding="utf-8")
    rel = path.relative_to(ROOT).as_posix()
    return [f"{rel}:{line}: {kind}: {phrase!r}"
            for line, text in comment_blocks(source) + docstrings(source)
            for kind, phrase in history_phrases(text)]


FILES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=[p.relative_to(ROOT).as_posix() for p in FILES])
def test_comments_and_docstrings_tell_why_not_history(path: Path):
    problems = problems_in(path)
    assert not problems, ("say why the code is as it is (what changed and when: CHANGELOG.md)\n"
                          + "\n".join(problems))


@pytest.mark.parametrize("text", [
    "jvp: the default before finite_difference",
    "gen_batch_size is hashed as before (an explicit integer keeps its hash)",
    "not in __all__, as before the split",
    "null now means the data set's own size",
    "the key of the chunk-seeded draws as it was before the sampler keys existed",
    "`probe_rework:` is the section `sampler:` had until its rename",
    "measured 2026-11-26 on the 2-core machine",
    "this used to be a list of keys",
    "the loss was previously averaged per sequence",
    "the spelling sections had before they were renamed",
    "hashed under its old name",
    "HASHED_WHEN_CHANGED drops the earlier behaviour",
    "the flag was removed",
    "the hook is no longer needed",
    "and U_df since it was added",
    "the pieces method that was the default",
])
def test_history_phrasing_is_flagged(text: str):
    assert history_phrases(text), text


@pytest.mark.parametrize("text", [
    "cast the effective parameters to `dtype` before the forward",
    "upcast logits before the softmax maths",
    "ΔH (or a pair of its own) runs before the error bars",
    "warnings of an earlier run in this process are not this run's",
    "Self-normalised IS estimate of the entropy under θ' on the old sequences",
    "the share of the term direction kept from earlier steps",
    "the gradient before the moments, a different step",
    "Copy the resolver table before adding to it",
    "how the batch was drawn (the sampler's record)",
    "an end is settled when the half-width there is within 2 % of the one it was solved with",
    "the gradients now in `.grad`",
    "the tokenizer used to score E",
    "where the saved second moment is exactly 0 (LoRA's B after the first step, whose gradient there was 0)",
    "ΔH at lr, 10·lr, 100·lr was off by 90×, 13× and 36 % of the fp32 value",
    "the legacy key names of the seed API",
    "as before each step, the moments are read from the optimizer",
    "no next step at all: said before any reuse",
])
def test_time_order_is_not_history(text: str):
    assert not history_phrases(text), history_phrases(text)

"""The `what_if` config section: how `run --what-if … --solve …` reports (docs/maths.md §6)."""

from __future__ import annotations

from pydantic import Field

from .sections import _Section


class WhatIfSection(_Section):
    """`run --what-if … --solve …` (docs/maths.md §6 "Solving for a coefficient"): the level of the solved
    coefficient's interval, {c : |δH₁(c) − target| ≤ t_df·SE(c)} at this two-sided coverage."""

    level: float = Field(0.95, gt=0, lt=1)

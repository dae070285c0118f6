"""Checks of a run's numbers against references computed without the product's formula for them."""

from __future__ import annotations


def lr_times_snis_slope(res: dict) -> float:
    """δH₁ measured independently of X̂: lr × (ΔH(+η) − ΔH(−η)) / 2η at the smallest symmetric η, the derivative
    along v of the SNIS entropy estimate re-scored at θ ± ηv on the same E. The causal X̂·v estimates the same
    derivative on the same sequences; the two differ by an E-side fluctuation of the order of SE_E."""
    rows = {row["eta"]: row["deltaH_true"] for row in res["true"]}
    eta = min(e for e in rows if e > 0 and -e in rows)
    return res["learning_rate"] * (rows[eta] - rows[-eta]) / (2 * eta)

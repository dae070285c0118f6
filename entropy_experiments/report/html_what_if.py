"""report.html's what-if section (html_report.py): results.json `what_if_baseline`, `what_if[]` and `solve`
(`entropy-probe run --what-if … --solve …`, probe/what_if.py) as two tables; nothing for a run without them.

The numbers are results.json's as they are; only z = diff / paired SE is formed here, and a difference that is
exactly 0 with SE 0 (the variant's step is the baseline's, e.g. KL-Cov or ε_high on-policy) is said so.
"""

from __future__ import annotations

import math

from .html_parts import num, num_cell, rows_table, text_html

NOTE = ('<p class="note">δH₁ of the run\'s objective with one key changed, on the <b>same</b> E and U as the run '
        "(X̂ shared; one U backward per variant). <b>diff</b> is the variant's δH₁ minus the baseline's with the "
        "<b>paired</b> jackknife SE (the same E units and U groups dropped from both), which is what decides "
        "between knobs; z = diff / paired SE.</p>")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def plus_minus(value, se) -> str:
    """`value ± se` for a cell ("—" for a missing number)."""
    return f"{num(value, '+.4g')} ± {num(se, '.2g')}"


def _cell(text: str) -> str:
    return f'<td class="n">{text}</td>'


def _diff_cells(row: dict) -> list[str]:
    """The paired difference and its z; a difference that is exactly zero (SE 0) says so instead."""
    diff, se = row.get("diff"), row.get("diff_se")
    if diff == 0 and se == 0:
        return [_cell("0 exactly (the baseline's step)"), _cell("—")]
    z = diff / se if _finite(diff) and _finite(se) and se > 0 else None
    return [_cell(plus_minus(diff, se)), num_cell(z, "+.2f")]


def _sides_cell(entry: dict) -> str:
    """SE_E / SE_U with SE_U's degrees of freedom; without SE_U, that the total is missing for want of it."""
    se_u, df = entry.get("se_U"), entry.get("se_U_df")
    if not _finite(se_u):
        return _cell(f"{num(entry.get('se_E'), '.2g')} / — (one U group: no total SE)")
    return _cell(f"{num(entry.get('se_E'), '.2g')} / {num(se_u, '.2g')}" + (f", df {df:.0f}" if _finite(df) else ""))


def variants_table(base: dict, rows: list[dict]) -> str:
    """One row for the baseline objective, then one per --what-if variant."""
    out = [["<td>baseline (the run's objective)</td>", _cell(plus_minus(base.get("deltaH1"), base.get("se"))),
            _sides_cell(base), _cell("—"), _cell("—")]]
    for row in rows:
        label = text_html(f"{row.get('key')}={row.get('value')}")
        out.append([f"<td><code>{label}</code></td>", _cell(plus_minus(row.get("deltaH1"), row.get("se"))),
                    _sides_cell(row), *_diff_cells(row)])
    return rows_table(["objective", "δH₁ ± SE", "SE_E / SE_U", "diff from baseline ± paired SE", "z"], out,
                      table_id="what-if-table")


def _end(x) -> str:
    return num(x, ".4g") if _finite(x) else "unbounded"


def solve_table(solved: dict) -> str:
    """The solved knob: its value, its interval at the stated level with the SE at each end, and the check there."""
    key = f"<code>{text_html(str(solved.get('key')))}</code>"
    target = num(solved.get("target"), "g")
    if solved.get("value") is None:
        return (f'<p id="what-if-solve">Solve {key} for δH₁ = {target}: not reached — '
                f"{text_html(str(solved.get('reason', '')))}</p>")
    lo, hi = (solved.get("interval") or [None, None])[:2]
    level = solved.get("level")
    items = [("solved for", f"{key} at δH₁ = {target}"), ("value", num(solved["value"], ".4g")),
             (f"{num(100 * level, 'g') if _finite(level) else '?'} % interval (|δH₁(c) − target| ≤ t·SE(c))",
              f"[{_end(lo)}, {_end(hi)}]")]
    for name, end in zip(("lo", "hi"), solved.get("ends") or []):
        if end:
            at = f"{num(end.get('se'), '.2g')} ({num(end.get('quantile'), '.3g')}, {num(end.get('df'), '.3g')})"
            items.append((f"SE at {name} (t quantile, df)", at))
    if solved.get("interval_note"):
        items.append(("⚠ the set", text_html(str(solved["interval_note"]))))
    items += [("δH₁ ± SE of a U backward at the value", plus_minus(solved.get("deltaH1"), solved.get("se"))),
              ("|δH₁ there − interpolated δH₁|", num(solved.get("interpolation_error"), ".2g"))]
    return rows_table(["", ""], [[f"<th>{k}</th>", f"<td>{v}</td>"] for k, v in items], table_id="what-if-solve")


def what_if_section(results: dict) -> str:
    """The section ("" when results.json has no what-if)."""
    base = results.get("what_if_baseline")
    if not base:
        return ""
    out = ['<h2 id="what-if">What-if: other objectives on the same E and U</h2>', NOTE,
           variants_table(base, results.get("what_if") or [])]
    solved = results.get("solve")
    if solved:
        out.append("<p class='note'>The coefficient at which δH₁ reaches the target (the loss is affine in it, "
                   "δH₁ is not: AdamW), and the interval of every c whose δH₁ is within t·SE(c) of the target at the stated "
                   "level (SE evaluated at each end, t at its degrees of freedom).</p>")
        out.append(solve_table(solved))
    seconds = results.get("what_if_seconds")
    if _finite(seconds):
        out.append(f"<p class='note'>The what-if took {seconds:.1f} s after the run.</p>")
    return "\n".join(out)

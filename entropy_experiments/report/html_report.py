"""report.html: one self-contained page per run directory (docs/attribution.md), opened from disk in a browser.

No network and no script: inline CSS, an inline SVG plot, and a CSS-only toggle (two radio buttons) between
colouring the E tokens by their entropy H_t and by the direct part of their predicted change, lr·D_v H_t along the
fixed responses (a note splits δH₁ into that part and the score-function part); hovering a token shows
its values. Reads results.json, E_tokens.parquet / .jsonl and the saved E_batch.pt / U_batch.pt for the prompt
texts (each optional but results.json). Untrusted text goes through html_parts.text_html / attr.
"""

from __future__ import annotations

from pathlib import Path

from .. import io_utils
from ..errors import output_error_on_os_error
from .html_parts import (
    H_RGB,
    attr,
    delta_h_svg,
    num,
    num_cell,
    rgba,
    rows_table,
    scale_of,
    shared_template,
    signed_colour,
    text_html,
    varying_part,
)
from .html_what_if import what_if_section
from .results_schema import load_results
from .run_dir import HTML_REPORT_FILE, RunDirectory
from .run_lines import objective_lines
from .summary import (
    SCALE_FREE_NOTE,
    run_label,
    u_df_text,
    verdict_line,
)
from .token_table import read_token_table

MAX_SEQUENCES = 60     # E responses rendered: those with the largest Σ|dH| (all of them when fewer)
PROMPT_CHARS = 600     # prompt text shown before the rest is folded away

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#111;padding:0 16px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;vertical-align:top}
th{background:#f5f5f5;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.note{color:#555}.esc{color:#b91c1c;background:#fee2e2;font-family:monospace;font-size:12px}
bdi,.t{unicode-bidi:isolate}.plot text{font:11px system-ui,sans-serif}
.resp{white-space:pre-wrap;font-family:ui-monospace,monospace;border:1px solid #ddd;padding:6px;margin:4px 0 14px}
.t{border-radius:2px;cursor:default;box-shadow:inset -1px 0 0 rgba(255,255,255,.7)}.t:hover{outline:1px solid #111}
#view-H:checked~.responses .t{background:var(--h)}#view-dH:checked~.responses .t{background:var(--d)}
.bar{display:inline-block;height:10px;vertical-align:middle}.prompt{max-width:520px;white-space:pre-wrap}
"""


def header_section(res: dict) -> str:
    """What was probed and the verdict: checkpoint, objective, sizes and first order against measured ΔH, in the
    console summary's words (report/summary.verdict_line)."""
    counts = res.get("counts") or {}
    sizes = (f"B_E {counts.get('B_E')} sequences ({counts.get('E_tokens')} tokens) · B_U {counts.get('B_U')} "
             f"prompts × G {counts.get('G')} ({counts.get('U_tokens')} tokens)")
    objective = objective_lines((res.get("update") or {}).get("objective"))
    items = [("checkpoint", text_html(run_label(res) or "(not recorded)")),
             ("objective", text_html(" · ".join(objective)) if objective else "(not recorded)"),
             ("sizes", text_html(sizes)), ("verdict", text_html(verdict_line(res)))]
    rows = [[f"<th>{k}</th>", f'<td id="header-{k}">{v}</td>'] for k, v in items]
    return '<div id="header">' + rows_table(["", ""], rows) + "</div>"


def summary_section(res: dict) -> str:
    se, lr = res.get("se") or {}, res.get("learning_rate")
    items = [("δH₁ (predicted entropy change of one step)", f"{num(res.get('deltaH1'))} ± {num(se.get('total'))} nats"),
             ("SE_E / SE_U", f"{num(se.get('E'))} / {num(se.get('U'))}{u_df_text(se)}"), ("learning rate", num(lr)),
             ("normalize", text_html(str(res.get("normalize")))),
             ("H (per token / per sequence)", (f"{num((res.get('H_orig') or {}).get('per_token'))} / "
                                              f"{num((res.get('H_orig') or {}).get('per_sequence'))} nats"))]
    counts = res.get("counts") or {}
    items += [(text_html(k), text_html(str(v))) for k, v in counts.items()]
    out = ["<h2>Summary</h2>", rows_table(["", ""], [[f"<th>{k}</th>", f"<td>{v}</td>"] for k, v in items])]
    slope = res.get("x_hat_dot_v")
    rows = [[num_cell(r["eta"], ".3g"), num_cell(r.get("deltaH_true")), num_cell(r.get("se")),
             num_cell(r["eta"] * slope if slope is not None else None),
             num_cell(r.get("ess_frac"), ".3f"), num_cell(r.get("psis_khat"), ".3f")] for r in res.get("true") or []]
    if rows:
        out.append(rows_table(["η", "ΔH measured", "SE", "η·X̂·v (first order)", "ESS/N", "k̂"], rows))
    out.append(delta_h_svg(res.get("true") or [], slope or 0.0))
    out.append('<p class="note">Points: ΔH(η) by importance sampling on E ± SE; orange line: the first-order '
               'prediction η·X̂·v; violet circles: the second-order prediction (when computed).</p>')
    predictors = res.get("predictors") or {}
    if predictors:
        prow = [[f"<td>{text_html(name)}</td>", num_cell(e.get("delta_h1")), num_cell(e.get("se")),
                 num_cell(e.get("measured_over_predicted"), ".3f")] for name, e in predictors.items()]
        out.append(rows_table(["predictor", "δH (one step)", "SE", "measured/predicted"], prow))
        if any(e.get("scale_free") for e in predictors.values()):
            out.append(f'<p class="note">{text_html(SCALE_FREE_NOTE)}</p>')
    warnings = res.get("warnings") or []
    if warnings:
        out.append("<ul>" + "".join(f"<li>{text_html(w)}</li>" for w in warnings) + "</ul>")
    return "\n".join(out)


def _prompt_html(text: str | None) -> str:
    """A prompt (bidi-isolated, escaped; past PROMPT_CHARS folded into <details>) or a note that it was not saved."""
    if text is None:
        return '<span class="note">(prompt text not saved)</span>'
    head, rest = text[:PROMPT_CHARS], text[PROMPT_CHARS:]
    more = f"<details><summary>more</summary><bdi>{text_html(rest)}</bdi></details>" if rest else ""
    return f"<bdi>{text_html(head)}</bdi>{more}"


def template_section(template: tuple[str, str]) -> str:
    """The prompt template every U and E prompt shares, shown once (the rows show only their varying part)."""
    prefix, suffix = template
    if not (prefix or suffix):
        return ""
    return ('<h2>Shared prompt template</h2><p class="note">Every U and E prompt below is this text with its own '
            'part in place of ⟨…⟩; the rows show only that part.</p><div class="resp" id="template">'
            f'<bdi>{text_html(prefix)}</bdi><b>⟨…⟩</b><bdi>{text_html(suffix)}</bdi></div>')


def _shown(prompts: list[str] | None, index: int, template: tuple[str, str]) -> str | None:
    """The varying part of prompt `index` (None when the prompt texts were not saved)."""
    if prompts is None or index >= len(prompts):
        return None
    return varying_part(prompts[index], template)


def u_section(att: dict, U_prompts: list[str] | None, template: tuple[str, str] = ("", "")) -> str:
    rows_in = att.get("U_groups")
    if not rows_in:
        return ("<h2>U prompt groups</h2><p class='note'>No U attribution (the error bars are off, or U has "
                "a single group).</p>")
    scale = max(abs(r["influence"]) for r in rows_in) or 1.0
    rows = []
    for rank, r in enumerate(rows_in, 1):
        width = 120 * abs(r["influence"]) / scale
        bar = f'<span class="bar" style="width:{width:.1f}px;background:{signed_colour(r["influence"], scale)}">'
        cells = "<hr>".join(_prompt_html(_shown(U_prompts, p, template)) for p in r["prompt_index"])
        rows.append([num_cell(rank, "d"), f"<td>{', '.join(str(p) for p in r['prompt_index'])}</td>",
                     f'<td class="prompt">{cells}</td>',
                     f"<td>{text_html(_fmt_lists(r['rewards']))}</td>",
                     f"<td>{text_html(_fmt_lists(r['advantages']))}</td>",
                     f'<td class="n">{num(r["influence"])} {bar}</span></td>', num_cell(r.get("delta_h1_without"))])
    s = att.get("U_summary") or {}
    note = (f"<p class='note'>influence = δH₁ − δH₁ without the group (v rebuilt by the exact AdamW step without "
            f"it). Σ influence = {num(s.get('sum_influence'))}, δH₁ = {num(s.get('delta_h1'))} "
            f"(ratio {num(s.get('sum_over_delta_h1'), '.3g')}): the influences are not shares of δH₁.</p>")
    return "<h2>U prompt groups by |influence| on δH₁</h2>" + note + rows_table(
        ["#", "U rows", "prompt", "rewards", "advantages", "influence (nats)", "δH₁ without"], rows)


def _fmt_lists(rows: list[list[float]]) -> str:
    return " | ".join(", ".join(f"{x:.3g}" for x in row) for row in rows)


def _token_span(token: str, H: float, dH: float, h_scale: float, d_scale: float) -> str:
    title = f"H = {H:.4f} nats\nlr·D_v H (direct part) = {dH:+.3e} nats"
    style = f"--h:{rgba(H_RGB, 0.85 * H / h_scale)};--d:{signed_colour(dH, d_scale)}"
    return (f'<span class="t" style="{style}" data-h="{H:.6g}" data-dh="{dH:.6g}" '
            f'title="{attr(title)}">{text_html(token)}</span>')


def _sequences(tokens: dict) -> dict[int, list[int]]:
    """{sequence: its table rows in position order}."""
    rows: dict[int, list[int]] = {}
    for i, n in enumerate(tokens["sequence"]):
        rows.setdefault(int(n), []).append(i)
    return {n: sorted(idx, key=lambda i: tokens["position"][i]) for n, idx in rows.items()}


def split_note(summary: dict, delta_h1) -> str:
    """δH₁ = the direct part (Σ dH / D, what the tokens are coloured by) + the score-function part (which responses
    get more likely, with the −Ĥ·R term), with numbers (docs/maths.md §3)."""
    direct = summary.get("direct_only")
    rest = delta_h1 - direct if isinstance(delta_h1, (int, float)) and isinstance(direct, (int, float)) else None
    return (f'<p class="note" id="direct-part-note">The token colours show only the <b>direct part</b> of δH₁: '
            f"lr·D_v H_t, how each token's entropy changes along the step with the response held fixed. "
            f"δH₁ = {num(delta_h1)} = direct part Σ dH / D {num(direct)} + score-function part {num(rest)} "
            "(which responses get more likely, and the −Ĥ·R term); the second is not shown per token.</p>")


def e_section(att: dict, tokens: dict | None, E_prompts: list[str] | None, G: int,
              template: tuple[str, str] = ("", ""), delta_h1=None) -> str:
    out = ["<h2>E tokens: entropy and the direct part of its predicted change</h2>"]
    summary = att.get("E_tokens")
    if summary:
        out.append(split_note(summary, delta_h1))
        shares = [[num_cell(100 * s["fraction"], "g"), num_cell(s["tokens"], "d"), num_cell(s["share_of_sum"], ".3f"),
                   num_cell(s["share_of_abs_sum"], ".3f")] for s in summary["top_shares"]]
        out.append(f"<p class='note'>{summary['tokens']} tokens; Σ dH = {num(summary['sum_dH'])} nats; "
                   f"Σ dH / D = {num(summary['direct_only'])} (the direct_only predictor).</p>")
        out.append(rows_table(["top % by |dH|", "tokens", "share of Σ dH", "share of Σ|dH|"], shares))
    if tokens is None:
        out.append("<p class='note'>No E token table in this run directory (predictors were off).</p>")
        return "\n".join(out)
    h_scale, d_scale = scale_of(tokens["H"], 1.0), scale_of(tokens["dH"])
    seqs = _sequences(tokens)
    order = sorted(seqs, key=lambda n: -sum(abs(tokens["dH"][i]) for i in seqs[n]))[:MAX_SEQUENCES]
    out.append('<input type="radio" name="view" id="view-H" checked> <label for="view-H">colour by H_t '
               f'(blue, full at {h_scale:.3g} nats)</label> &nbsp; <input type="radio" name="view" id="view-dH"> '
               f'<label for="view-dH">colour by lr·D_v H_t, the direct part (red: entropy rises, blue: falls; full at '
               f'{d_scale:.3g} nats)</label>')
    out.append(f"<p class='note'>{len(order)} of {len(seqs)} responses, those with the largest Σ|dH| first. "
               "Hover a token for its values.</p>")
    blocks = []
    for n in order:
        idx = seqs[n]
        prompt = _shown(E_prompts, n // G, template)
        spans = "".join(_token_span(tokens["token"][i], tokens["H"][i], tokens["dH"][i], h_scale, d_scale)
                        for i in idx)
        blocks.append(f'<div class="seq" id="seq-{n}"><b>sequence {n}</b> · Σ H = '
                      f'{num(sum(tokens["H"][i] for i in idx))} · Σ dH = {num(sum(tokens["dH"][i] for i in idx))}'
                      f' · prompt: {_prompt_html(prompt)}<div class="resp">{spans}</div></div>')
    out.append('<div class="responses">' + "".join(blocks) + "</div>")
    return "\n".join(out)


def render_html_report(results: dict, tokens: dict | None = None, E_batch: dict | None = None,
                       U_batch: dict | None = None, title: str = "entropy probe run") -> str:
    """The page as a string, from the results dict, the token table columns and the saved batches (optional)."""
    att = results.get("attribution") or {}
    G = int(E_batch["num_responses_per_prompt"]) if E_batch else 1
    U_prompts, E_prompts = (b.get("prompts") if b else None for b in (U_batch, E_batch))
    template = shared_template([*(U_prompts or []), *(E_prompts or [])])
    body = [f"<h1>{text_html(title)}</h1>", header_section(results), summary_section(results),
            what_if_section(results), template_section(template), u_section(att, U_prompts, template),
            e_section(att, tokens, E_prompts, G, template, results.get("deltaH1"))]
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{text_html(title)}</title><style>{CSS}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")


def write_html_report(run_dir: str | Path) -> Path:
    """Render `run_dir`/report.html from the files in the run directory; returns its path."""
    run = RunDirectory(run_dir)
    results = load_results(run.path)
    # the '/' in the title is written by us; only the directory name comes from the user
    html_text = render_html_report(results, read_token_table(run.path), run.load_batch("E"), run.load_batch("U"),
                                   title=f"entropy probe run · {run.path.resolve().name}")
    path = run.path / HTML_REPORT_FILE
    with output_error_on_os_error(f"cannot write {path}"):
        io_utils.atomic_write_text(path, html_text)
    return path

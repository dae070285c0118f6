"""Building blocks of report.html (html_report.py): escaping of untrusted text, colours and the inline SVG plot.

Everything that comes from prompts, responses or tokens goes through `text_html`: HTML-escaped, with control
characters and bidirectional formatting characters shown as visible escapes (\\x07, \\u202e) so that they can
neither break the page nor reorder the text around them; right-to-left text stays readable because every
token and prompt is a bidi-isolated element (`unicode-bidi: isolate`, <bdi>).
"""

from __future__ import annotations

import html
import math
import os
import unicodedata

# Bidirectional formatting characters (Cf): embeddings, overrides, isolates and marks.
BIDI_CONTROLS = frozenset("\u200e\u200f\u061c\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
KEPT_WHITESPACE = frozenset("\n\t")


def visible_escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def text_html(text: str) -> str:
    """`text` safe inside an element: HTML-escaped, control and bidi characters as visible escapes (marked)."""
    out = []
    for ch in str(text):
        if ch in KEPT_WHITESPACE:
            out.append(ch)
        elif ch in BIDI_CONTROLS or unicodedata.category(ch) in ("Cc", "Cs") or ch in "\u2028\u2029":
            out.append(f'<span class="esc">{visible_escape(ch)}</span>')
        else:
            out.append(html.escape(ch))
    return "".join(out)


def attr(text: str) -> str:
    """`text` safe inside a double-quoted attribute (controls and bidi characters as visible escapes)."""
    cleaned = "".join(visible_escape(ch) if (ch in BIDI_CONTROLS or (unicodedata.category(ch) == "Cc"
                                                                     and ch not in KEPT_WHITESPACE))
                      else ch for ch in str(text))
    return html.escape(cleaned, quote=True)


def num(x, fmt: str = ".4g") -> str:
    """A number for the page ("—" for None / NaN)."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return format(x, fmt)


def num_cell(x, fmt: str = ".4g") -> str:
    """A right-aligned table cell holding the number `x`."""
    return f'<td class="n">{num(x, fmt)}</td>'


def rows_table(header: list[str], rows: list[list[str]], cls: str = "", table_id: str = "") -> str:
    """A <table> of header cells `header` (HTML) and rows of ready cells (<td>/<th> HTML)."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(row) + "</tr>" for row in rows)
    ident = f' id="{table_id}"' if table_id else ""
    return f'<table class="{cls}"{ident}><tr>{head}</tr>{body}</table>'


def rgba(rgb: tuple[int, int, int], alpha: float) -> str:
    a = min(max(alpha, 0.0), 1.0)
    return f"rgba({rgb[0]},{rgb[1]},{rgb[2]},{a:.3f})"


H_RGB = (37, 99, 235)          # entropy: blue, darker = higher H
UP_RGB, DOWN_RGB = (220, 38, 38), (37, 99, 235)  # predicted change: red = entropy rises, blue = falls


def scale_of(values: list[float], quantile: float = 0.99) -> float:
    """The colour scale's full value: the `quantile` of |values| (one extreme token does not wash out the rest)."""
    mags = sorted(abs(v) for v in values if v is not None and math.isfinite(v))
    if not mags:
        return 1.0
    top = mags[min(len(mags) - 1, int(quantile * (len(mags) - 1) + 0.5))]
    return top if top > 0 else (mags[-1] or 1.0)


def signed_colour(value: float, scale: float) -> str:
    return rgba(UP_RGB if value >= 0 else DOWN_RGB, 0.85 * abs(value) / scale)


# ----------------------------------------------------------------------------- the SVG plot
def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def delta_h_svg(rows: list[dict], slope: float, *, second_order: bool = True, width: int = 600,
                height: int = 340) -> str:
    """Inline SVG of the measured ΔH(η) ± SE against the first-order prediction η·slope (and the second-order
    prediction where rows carry one). rows: results.json `true`; slope = X̂·v (x_hat_dot_v)."""
    pts = [(r["eta"], r["deltaH_true"], r.get("se")) for r in rows if r.get("deltaH_true") is not None]
    if not pts:
        return '<p class="note">ΔH(η) was not measured (importance sampling off).</p>'
    left, right, top, bottom = 78, 18, 16, 46
    etas = [p[0] for p in pts] + [0.0]
    x_lo, x_hi = min(etas), max(etas)
    ys = [slope * e for e in etas] + [y + s * k for _, y, s in pts for k in (-1, 1) if s is not None] + [0.0]
    y_lo, y_hi = min(ys), max(ys)
    pad_x, pad_y = 0.05 * (x_hi - x_lo or 1.0), 0.08 * (y_hi - y_lo or 1.0)
    x_lo, x_hi, y_lo, y_hi = x_lo - pad_x, x_hi + pad_x, y_lo - pad_y, y_hi + pad_y

    def X(e):
        return left + (e - x_lo) / (x_hi - x_lo) * (width - left - right)

    def Y(v):
        return top + (y_hi - v) / (y_hi - y_lo) * (height - top - bottom)

    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" viewBox="0 0 {width} {height}" '
             f'width="{width}" height="{height}" role="img" aria-label="ΔH(η) against the prediction">'),
             (f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
             'fill="#fff" stroke="#999"/>')]
    for t in _ticks(x_lo, x_hi):
        parts.append(f'<text x="{X(t):.1f}" y="{height - bottom + 16}" text-anchor="middle">{t:.2g}</text>')
    for t in _ticks(y_lo, y_hi):
        parts.append(f'<text x="{left - 6}" y="{Y(t) + 4:.1f}" text-anchor="end">{t:.2g}</text>')
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{Y(t):.1f}" y2="{Y(t):.1f}" stroke="#eee"/>')
    parts.append(f'<text x="{(left + width - right) / 2}" y="{height - 8}" text-anchor="middle">η</text>')
    parts.append(f'<text x="14" y="{(top + height - bottom) / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {(top + height - bottom) / 2})">ΔH (nats)</text>')
    parts.append(f'<line x1="{X(x_lo):.1f}" y1="{Y(slope * x_lo):.1f}" x2="{X(x_hi):.1f}" y2="{Y(slope * x_hi):.1f}" '
                 'stroke="#d97706" stroke-width="2"><title>first order η·X̂·v</title></line>')
    second = [(r["eta"], r["second_order_prediction"]) for r in rows
              if second_order and r.get("second_order_prediction") is not None]
    for e, y in second:
        parts.append(f'<circle cx="{X(e):.1f}" cy="{Y(y):.1f}" r="4" fill="none" stroke="#7c3aed">'
                     f'<title>second order at η={e:.3g}: {y:.4g}</title></circle>')
    for e, y, s in pts:
        if s is not None:
            parts.append(f'<line x1="{X(e):.1f}" x2="{X(e):.1f}" y1="{Y(y - s):.1f}" y2="{Y(y + s):.1f}" '
                         'stroke="#111"/>')
        parts.append(f'<circle cx="{X(e):.1f}" cy="{Y(y):.1f}" r="3.5" fill="#111"><title>η={e:.3g}: '
                     f'ΔH={y:.4g} ± {num(s)}</title></circle>')
    parts.append("</svg>")
    return "".join(parts)


# ----------------------------------------------------------------------------- the shared prompt template
MIN_TEMPLATE_CHARS = 20  # a common prefix + suffix shorter than this is left in every row


def shared_template(prompts: list[str]) -> tuple[str, str]:
    """(prefix, suffix) every one of `prompts` starts and ends with (a chat template around the question), so the
    page can show it once and each row only its varying part; ('', '') for fewer than two prompts or when the
    shared text is under MIN_TEMPLATE_CHARS."""
    if len(prompts) < 2:
        return "", ""
    prefix = os.path.commonprefix(prompts)
    room = min(len(p) for p in prompts) - len(prefix)
    suffix = os.path.commonprefix([p[::-1] for p in prompts])[:room][::-1]
    if len(prefix) + len(suffix) < MIN_TEMPLATE_CHARS:
        return "", ""
    return prefix, suffix


def varying_part(prompt: str, template: tuple[str, str]) -> str:
    """`prompt` without the shared `template` (prefix, suffix) of shared_template."""
    prefix, suffix = template
    return prompt[len(prefix):len(prompt) - len(suffix)]

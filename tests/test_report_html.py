"""report.html (docs/attribution.md): written by a real tiny run, re-rendered by `entropy-probe report`, escaped,
and shown by a real browser (headless Chromium; those tests skip with the reason where it is not installed).

The tiny run's prompts carry HTML tags, right-to-left text, bidi overrides and control characters, so the page
a browser renders is checked on exactly the text a user could feed it. A second tiny run with `what_if` checks
the what-if section (report/html_what_if.py) the same way; made-up results check its edge cases.
"""

from __future__ import annotations

import html.parser
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from entropy_experiments import cli
from entropy_experiments.config import config_from_dict
from entropy_experiments.probe.runner import run_probe
from entropy_experiments.probe.what_if import WhatIfRequest
from entropy_experiments.report.html_report import render_html_report
from entropy_experiments.report.html_what_if import plus_minus
from entropy_experiments.report.token_table import read_token_table
from tests.probe_helpers import write_prompts
from tests.report_helpers import fake_results
from tests.run_helpers import logging_restored, make_run_setup

BAD_PROMPTS = ["<script>alert('p')</script> 2 + 2?", "مرحبا بالعالم؟ what is 3 + 4", "left \u202eright-to-left override",
               "bell\x07 escape\x1b[31m red", "</td></tr></table><img src=x onerror=alert(1)>", "plain prompt"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                                    "(Debian: apt-get install -y chromium)")


@pytest.fixture(scope="module")
def tiny_run(tiny_model_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("report_run")
    _, config = make_run_setup(folder, tiny_model_dir, batch_config={"B_E": 6, "B_U": 4, "G": 2},
                               importance={"eta_list": [1e-4, 1e-3]}, second_order={"enabled": False})
    config["batch_config"]["dataset_path"] = str(write_prompts(folder / "bad.jsonl", BAD_PROMPTS))
    with logging_restored():
        run_probe(config_from_dict(config), out=str(folder / "run"))
    return folder / "run"


class Tags(html.parser.HTMLParser):
    """Every start tag with its attributes, and the text, of a page."""

    def __init__(self):
        super().__init__()
        self.tags, self.text = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def _parsed(page: str) -> Tags:
    tags = Tags()
    tags.feed(page)
    return tags


def _assert_inert(page: str) -> None:
    tags = _parsed(page)
    names = {t for t, _ in tags.tags}
    assert not names & {"script", "img", "iframe", "object", "link"}, names
    assert not [a for _, attrs in tags.tags for a in attrs if a.startswith("on")]
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in page
    for raw in ("\u202e", "\x07", "\x1b"):
        assert raw not in page, repr(raw)


@pytest.mark.e2e
def test_a_run_writes_the_token_table_and_the_report(tiny_run):
    results = json.loads((tiny_run / "results.json").read_text())
    table = read_token_table(tiny_run)
    assert (tiny_run / "E_tokens.parquet").exists()
    import pyarrow.parquet as pq

    assert pq.read_table(tiny_run / "E_tokens.parquet").column_names == ["sequence", "position", "token_id", "token",
                                                                         "H", "dH"]
    assert len(table["H"]) == results["counts"]["E_tokens"] == results["attribution"]["E_tokens"]["tokens"]
    assert np.isclose(sum(table["dH"]), results["attribution"]["E_tokens"]["sum_dH"], rtol=1e-12)
    page = (tiny_run / "report.html").read_text(encoding="utf-8")
    _assert_inert(page)
    assert page.count('class="t"') == len(table["H"])  # every E token of the 6 responses is rendered
    assert page.count("<tr>") >= 1 + len(results["attribution"]["U_groups"])
    # the bad prompts are in the page, escaped and visible
    assert "&lt;script&gt;alert(&#x27;p&#x27;)&lt;/script&gt;" in page or "&lt;script&gt;" in page
    assert '<span class="esc">\\u202e</span>' in page and '<span class="esc">\\x07</span>' in page
    assert "مرحبا" in page


@pytest.mark.e2e
def test_entropy_probe_report_rerenders_the_page(tiny_run, tmp_path):
    copy = Path(shutil.copytree(tiny_run, tmp_path / "copy"))
    before = (copy / "report.html").read_text(encoding="utf-8")
    (copy / "report.html").unlink()
    with logging_restored():
        assert cli.main(["report", str(copy)]) == 0
    after = (copy / "report.html").read_text(encoding="utf-8")
    assert after.replace("copy", "run") == before.replace("copy", "run")


def test_untrusted_tokens_and_prompts_render_escaped():
    tokens = ["<b>bold</b>", "\u202eevil", "\x00nul", "\u05e9\u05dc\u05d5\u05dd", "\n", "&amp;", '"quote"']
    n = len(tokens)
    table = {"sequence": [0] * n, "position": list(range(n)), "token_id": list(range(n)), "token": tokens,
             "H": [0.1 * (i + 1) for i in range(n)], "dH": [(-1) ** i * 1e-4 * (i + 1) for i in range(n)]}
    att = {"U_groups": [{"group": 0, "prompt_index": [0], "influence": 2e-5, "delta_h1_without": 1e-5,
                         "rewards": [[1.0, 0.0]], "advantages": [[0.5, -0.5]]}],
           "U_summary": {"sum_influence": 2e-5, "delta_h1": 3e-5, "sum_over_delta_h1": 0.67, "groups": 1},
           "E_tokens": None}
    page = render_html_report(fake_results(attribution=att), table,
                              {"prompts": ["<i>E</i>\x1b"], "num_responses_per_prompt": 1},
                              {"prompts": ["</table><script>x()</script>"]}, title="<title>")
    _assert_inert(page)
    assert "&lt;b&gt;bold&lt;/b&gt;" in page and "&lt;/table&gt;&lt;script&gt;x()&lt;/script&gt;" in page
    assert '<span class="esc">\\x00</span>nul' in page and "&amp;amp;" in page and "שלום" in page
    assert page.count('class="t"') == n


def _chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--no-first-run", "--hide-scrollbars", *args], check=True, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.e2e
@needs_chromium
def test_chromium_shows_the_table_and_the_coloured_tokens(tiny_run, tmp_path):
    from PIL import Image

    page = tiny_run / "report.html"
    dom = _chromium("--dump-dom", page.as_uri()).stdout
    results = json.loads((tiny_run / "results.json").read_text())
    tags = _parsed(dom)
    spans = [a for t, a in tags.tags if t == "span" and a.get("class") == "t"]
    assert len(spans) == results["counts"]["E_tokens"]
    assert all("--h:rgba(" in a["style"] and "--d:rgba(" in a["style"] and "H = " in a["title"] for a in spans)
    assert sum(1 for t, _ in tags.tags if t == "tr") >= len(results["attribution"]["U_groups"]) + 1
    assert "U prompt groups by |influence|" in "".join(tags.text)
    shot = tmp_path / "report.png"
    _chromium(f"--screenshot={shot}", "--window-size=1200,2400", page.as_uri())
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3).astype(int)
    r, g, b = pixels.T
    blue = int(((b - r > 40) & (b - g > 20)).sum())  # tokens coloured by H (the default view)
    assert blue > 200, blue


# ----------------------------------------------------------------------------- the what-if section
WHAT_IFS = (("objective.entropy_coef", 0.05), ("objective.top_entropy_quantile", 0.5),
            ("objective.epsilon_high", 0.28))  # the last is inactive at ratio 1: exactly the baseline's step


@pytest.fixture(scope="module")
def what_if_run(tiny_model_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("what_if_report")
    _, config = make_run_setup(folder, tiny_model_dir, batch_config={"B_E": 6, "B_U": 4, "G": 2},
                               objective={"trainer": "trl"}, importance={"eta_list": [1e-3], "symmetric": False},
                               second_order={"enabled": False}, predictors={"enabled": False},
                               variance={"u_groups": 4})
    request = WhatIfRequest(WHAT_IFS, "objective.entropy_coef", 0.0)
    with logging_restored():
        run_probe(config_from_dict(config), out=str(folder / "run"), what_if=request)
    return folder / "run"


def _cell_texts(dom: str, table_id: str) -> list[list[str]]:
    """The text of each cell of the table `table_id`, row by row, from a page's DOM."""
    start = dom.index(f'id="{table_id}"')
    table = dom[start:dom.index("</table>", start)]
    rows = []
    for tr in table.split("<tr>")[1:]:
        cells = [c.split(">", 1)[1] if ">" in c else c for c in tr.replace("</th>", "</td>").split("</td>")[:-1]]
        rows.append(["".join(_parsed(c).text).strip() for c in cells])
    return rows


@pytest.mark.e2e
@needs_chromium
def test_chromium_shows_the_what_if_table_and_the_solved_knob(what_if_run):
    results = json.loads((what_if_run / "results.json").read_text())
    page = what_if_run / "report.html"
    _assert_inert(page.read_text(encoding="utf-8"))
    dom = _chromium("--dump-dom", page.as_uri()).stdout
    assert "What-if: other objectives on the same E and U" in "".join(_parsed(dom).text)
    rows = _cell_texts(dom, "what-if-table")
    assert rows[0] == ["objective", "δH₁ ± SE", "SE_E / SE_U", "diff from baseline ± paired SE", "z"]
    base = results["what_if_baseline"]
    assert rows[1][:2] == ["baseline (the run's objective)", plus_minus(base["deltaH1"], base["se"])]
    assert len(rows) == 2 + len(WHAT_IFS)
    for row, entry in zip(rows[2:], results["what_if"]):
        assert row[0] == f"{entry['key']}={entry['value']}"
        assert row[1] == plus_minus(entry["deltaH1"], entry["se"])
    coef, mask, clip_high = results["what_if"]
    for entry, row in ((coef, rows[2]), (mask, rows[3])):
        assert entry["diff"] != 0 and row[3] == plus_minus(entry["diff"], entry["diff_se"])
        assert float(row[4]) == pytest.approx(entry["diff"] / entry["diff_se"], abs=0.006)
    # ε_high does not act on the first on-policy step: the same v, a difference of exactly 0
    assert clip_high["diff"] == 0.0 and clip_high["diff_se"] == 0.0
    assert rows[4][3] == "0 exactly (the baseline's step)"
    solved = results["solve"]
    assert solved["value"] is not None
    solve_rows = dict(_cell_texts(dom, "what-if-solve")[1:])
    assert solve_rows["value"] == format(solved["value"], ".4g")
    lo, hi = ("unbounded" if x is None else format(x, ".4g") for x in solved["interval"])
    level = format(100 * solved["level"], "g")
    assert solve_rows[f"{level} % interval (|δH₁(c) − target| ≤ t·SE(c))"] == f"[{lo}, {hi}]"
    assert solve_rows["δH₁ ± SE of a U backward at the value"] == plus_minus(solved["deltaH1"], solved["se"])


def _what_if_results(**solve) -> dict:
    base = {"deltaH1": -1.2e-4, "se": 3e-5, "se_E": 2e-5, "se_U": 2.2e-5}
    rows = [{"key": "objective.entropy_coef", "value": 0.01, "deltaH1": -0.9e-4, "se": 3e-5, "se_E": 2e-5,
             "se_U": 2.2e-5, "diff": 3e-5, "diff_se": 1e-5, "diff_se_E": 6e-6, "diff_se_U": 8e-6, "u_loss": 0.1},
            {"key": "objective.loss_type", "value": "<b>grpo</b>\u202e", "deltaH1": -1.2e-4, "se": 3e-5,
             "se_E": 2e-5, "se_U": 2.2e-5, "diff": 0.0, "diff_se": 0.0, "diff_se_E": 0.0, "diff_se_U": 0.0,
             "u_loss": 0.1}]
    return fake_results(what_if_baseline=base, what_if=rows, solve=solve or None, what_if_seconds=1.5)


def test_no_what_if_no_section():
    page = render_html_report(fake_results())
    assert "what-if" not in page.lower()
    assert 'id="what-if"' in render_html_report(_what_if_results())


def test_what_if_values_are_escaped_and_an_exact_zero_is_named():
    page = render_html_report(_what_if_results())
    _assert_inert(page)
    assert "&lt;b&gt;grpo&lt;/b&gt;" in page and '<span class="esc">\\u202e</span>' in page
    rows = _cell_texts(page, "what-if-table")
    assert rows[2][3] == "+3e-05 ± 1e-05" and rows[2][4] == "+3.00"
    assert rows[3][3] == "0 exactly (the baseline's step)" and rows[3][4] == "—"
    assert "took 1.5 s" in page


def test_solved_knob_with_an_open_side_and_an_unreached_target():
    lo = {"value": 0.004, "se": 2.5e-5, "se_E": 2e-5, "se_U": 1.5e-5, "df": 7.2, "quantile": 2.35, "settled": True}
    page = render_html_report(_what_if_results(key="objective.entropy_coef", target=0.0, value=0.0123, level=0.95,
                                               interval=[0.004, None], ends=[lo, None], interval_note=None,
                                               deltaH1=1e-9, se=3e-5, interpolation_error=2e-10))
    solve_rows = dict(_cell_texts(page, "what-if-solve")[1:])
    assert solve_rows["value"] == "0.0123" and solve_rows["95 % interval (|δH₁(c) − target| ≤ t·SE(c))"] == \
        "[0.004, unbounded]"
    assert solve_rows["SE at lo (t quantile, df)"] == "2.5e-05 (2.35, 7.2)" and "SE at hi (t quantile, df)" not in solve_rows
    page = render_html_report(_what_if_results(key="objective.entropy_coef", target=0.5, value=None,
                                               interval=[None, None], deltaH1=None, se=None,
                                               interpolation_error=None, reason="δH₁ does not reach 0.5"))
    assert 'id="what-if-solve"' in page and "not reached — δH₁ does not reach 0.5" in page


def test_scale_free_proxies_carry_their_units_note():
    """A predictors table with a scale-free proxy says that its number is not nats/token (the note once); one without
    proxies has no such note."""
    adamw = {"delta_h1": -1.2e-4, "se": 2e-5, "measured_over_predicted": 1 / 1.1}
    proxy = {"delta_h1": 0.37, "se": None, "measured_over_predicted": None, "scale_free": True}
    with_proxy = render_html_report(fake_results(predictors={"adamw_step": adamw, "cui_npg": proxy}))
    without = render_html_report(fake_results(predictors={"adamw_step": adamw}))
    note = "not nats/token"
    assert with_proxy.count(note) == 1 and note not in without


@pytest.mark.parametrize("layout", ["own", "trainer"])
def test_header_names_the_checkpoint_results_json_records(tmp_path, layout):
    """The header's checkpoint is the directory results.json's `checkpoint` entry was read from (the entry as
    checkpoint_info writes it for a file tree laid out by hand), in the page and the console summary."""
    from entropy_experiments.checkpoint.base_model import BaseModelChoice
    from entropy_experiments.checkpoint.layout import checkpoint_info, resolve_checkpoint
    from entropy_experiments.checkpoint.learning_rate import LearningRate
    from entropy_experiments.report.summary import render_summary, run_label

    root = tmp_path / "checkpoint-40"
    adapter = root / "model" if layout == "own" else root
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "Org/base"}')
    (root / "optimizer.pt").write_bytes(b"")
    if layout == "trainer":
        (root / "trainer_state.json").write_text("{}")
    info = checkpoint_info(resolve_checkpoint(str(root), None, None), BaseModelChoice("Org/base", "config"),
                           LearningRate(1e-5, "config"))
    results = json.loads(json.dumps(fake_results(checkpoint=info)))  # as read back from results.json
    header = dict(_cell_texts(render_html_report(results), "header")[1:])
    assert header["checkpoint"] == str(root) == run_label(results)
    assert str(root) in render_summary(results)

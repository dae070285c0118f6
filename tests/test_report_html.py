"""report.html (docs/attribution.md): written by a real tiny run, re-rendered by `entropy-probe report`, escaped,
and shown by a real browser (headless Chromium; those tests skip with the reason where it is not installed).

The tiny run's prompts carry HTML tags, right-to-left text, bidi overrides and control characters, so the page
a browser renders is checked on exactly the text a user could feed it.
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
from entropy_experiments.report.html_report import render_html_report
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

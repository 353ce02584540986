"""The HTML head view in a real browser (Debian's headless Chromium driven by playwright):
opened from disk, offline, clicked through, and checked against the model's weights."""

from __future__ import annotations

import json
import re

import pytest
import torch

from multihead.inspect import for_text
from multihead.viz.html import MIN_WEIGHT, head_view, save_head_view

TEXT = "The animal didn't cross the street because it was too tired"


@pytest.fixture(scope="module")
def page_file(pretrained, tmp_path_factory):
    batch, out = pretrained([TEXT], return_weights=True)
    n = int(batch.lengths[0])
    weights = for_text(out.weights, 0, n)
    focus = batch.tokens[0].index("it")
    path = tmp_path_factory.mktemp("view") / "attention.html"
    save_head_view(path, weights, batch.tokens[0], special=batch.special[0], focus=focus)
    return path, weights, batch.tokens[0], focus


def _embedded(page):
    return json.loads(page.locator("#data").text_content())


def _drawn(page):
    return page.eval_on_selector_all(
        "line.attn",
        "els => els.map(e => [+e.dataset.head, +e.dataset.query, +e.dataset.key,"
        " +e.dataset.weight])",
    )


def _expected(weights, layer, heads, query):
    return sorted(
        (h, query, k, float(weights[layer][h][query][k]))
        for h in heads
        for k in range(len(weights[layer][h][query]))
        if weights[layer][h][query][k] >= MIN_WEIGHT
    )


def test_file_has_no_external_reference(page_file):
    text = page_file[0].read_text()
    for pattern in ("http://", "https://", "//cdn", " src=", "href=", "@import", "url("):
        assert pattern not in text
    assert "default-src 'none'" in text  # the page itself forbids any fetch


def test_head_view_in_browser(page_file, browser, tmp_path):
    path, weights, tokens, focus = page_file
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_selector("line.attn")

    data = _embedded(page)
    assert data["tokens"] == tokens
    # the embedded weights are the model's, rounded to 5 decimals: off by at most half a unit
    embedded = torch.tensor(data["weights"], dtype=torch.float64)
    assert (embedded - weights.double()).abs().max() <= 5e-6 + 1e-12
    # opened on the focus token ("it"), layer 0, every head
    assert _drawn(page) and sorted(map(tuple, _drawn(page))) == _expected(
        data["weights"], 0, range(12), focus
    )
    assert page.locator(f"#query-{focus}").get_attribute("class").endswith("selected")

    # one head of another layer, another token, chosen by clicking
    page.click("#no-heads")
    assert _drawn(page) == []
    page.click("#head-3")
    page.select_option("#layer", "4")
    page.click("#query-2")
    drawn = sorted(map(tuple, _drawn(page)))
    assert drawn == _expected(data["weights"], 4, [3], 2)
    assert {d[0] for d in drawn} == {3} and {d[1] for d in drawn} == {2}
    # the table beside lists every key's weight for that head, in percent
    cells = page.eval_on_selector_all(
        "#weights td[data-head='3']", "els => els.map(e => e.textContent)"
    )
    assert cells == [f"{100 * w:.1f}%" for w in data["weights"][4][3][2]]
    assert 'Weights from "animal"' in page.text_content("#weights-title")

    # a second head adds its own colour
    page.click("#head-7")
    drawn = sorted(map(tuple, _drawn(page)))
    assert drawn == _expected(data["weights"], 4, [3, 7], 2)
    colours = page.eval_on_selector_all(
        "line.attn", "els => [...new Set(els.map(e => e.getAttribute('stroke')))]"
    )
    assert sorted(colours) == sorted([data["colours"][3], data["colours"][7]])

    # statistics beside the drawing follow the layer
    stats_row = page.eval_on_selector_all(
        "#stats tr:nth-child(2) td", "els => els.map(e => e.textContent)"
    )
    assert stats_row[1] == f"{data['stats']['entropy'][4][0]:.2f}"

    # unpinned and hovering: the hovered token's lines
    page.click("#unpin")
    page.hover("#query-5")
    assert {d[1] for d in _drawn(page)} == {5}

    shot = tmp_path / "head_view.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    assert requests == [path.as_uri()]
    assert errors == []
    page.close()


def _pixels_of(png: bytes, colour: str, tolerance: int = 24) -> int:
    """How many pixels of ``png`` are within ``tolerance`` (per channel) of ``colour``."""
    import io

    import numpy as np
    from PIL import Image

    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    want = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(rgb - want).max(axis=-1) <= tolerance).sum())


def test_twelve_heads_on_stay_distinguishable(page_file, browser):
    """With every head on, each drawn head shows in its own colour in the drawing (before,
    twelve half-transparent lines on the same path blended into one brown, and most heads'
    colours appeared nowhere)."""
    path, _, _, focus = page_file
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(path.as_uri())
    page.wait_for_selector("line.attn")
    data = _embedded(page)
    assert len(set(data["colours"])) == 12
    drawn = {h for h in range(12) if max(data["weights"][0][h][focus]) >= MIN_WEIGHT}
    assert len(drawn) == 12
    png = page.locator("#view").screenshot()
    for h in sorted(drawn):
        assert _pixels_of(png, data["colours"][h]) >= 30, f"head {h} ({data['colours'][h]})"
    page.close()


def test_head_view_bad_input():
    w = torch.rand(1, 2, 3, 3).softmax(-1)
    with pytest.raises(ValueError, match=r"one label per position \(3\)"):
        head_view(w, ["a", "b"])
    with pytest.raises(ValueError, match=r"focus must be a position in \[0, 3\)"):
        head_view(w, ["a", "b", "c"], focus=3)
    with pytest.raises(ValueError, match="keep inputs to 256 tokens"):
        head_view(torch.rand(1, 1, 300, 300), ["x"] * 300)


def test_script_closing_tag_in_a_token_is_escaped():
    w = torch.rand(1, 1, 2, 2).softmax(-1)
    page = head_view(w, ["</script><b>", "ok"])
    assert page.count("</script>") == 2  # the data and the code blocks, nothing injected
    assert re.search(r"<\\/script><b>", page)

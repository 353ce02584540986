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


def _expected_without_sinks(weights, layer, heads, query, sinks):
    """The lines the page draws with the sinks hidden: each row's sink columns at 0 and the
    rest renormalized, in float64 from the embedded (rounded) weights."""
    rows = []
    for h in heads:
        row = [0.0 if k in sinks else w for k, w in enumerate(weights[layer][h][query])]
        total = sum(row)
        rows += [(h, query, k, w / total) for k, w in enumerate(row) if w / total >= MIN_WEIGHT]
    return sorted(rows)


def test_hide_sinks_toggle_in_browser(page_file, browser, tmp_path):
    path, weights, tokens, focus = page_file
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_selector("line.attn")
    data = _embedded(page)
    assert data["sinks"] == [0, 14]  # [CLS] and [SEP], found by the page's builder
    assert page.text_content("#sinks-line").startswith(
        "Attention sinks: [CLS] (position 0: the first token, a special token"
    )
    toggle = page.locator("#hide-sinks")
    assert not toggle.is_checked() and toggle.is_enabled()  # raw by default
    raw = sorted(map(tuple, _drawn(page)))
    assert raw == _expected(data["weights"], 0, range(12), focus)

    toggle.check()
    page.select_option("#layer", "3")
    drawn = sorted(map(tuple, _drawn(page)))
    want = _expected_without_sinks(data["weights"], 3, range(12), focus, {0, 14})
    assert [d[:3] for d in drawn] == [w[:3] for w in want]
    assert max(abs(d[3] - w[3]) for d, w in zip(drawn, want)) <= 1e-12
    assert not {d[2] for d in drawn} & {0, 14}  # no line ends on a sink
    assert "hidden-sink" in page.get_attribute("#key-0", "class")
    # the table lists the other keys, renormalized, and says so
    page.click("#no-heads")
    page.click("#head-3")
    cells = page.eval_on_selector_all(
        "#weights td[data-head='3']", "els => els.map(e => [+e.dataset.key, e.textContent])"
    )
    row = [0.0 if k in (0, 14) else w for k, w in enumerate(data["weights"][3][3][focus])]
    assert cells == [
        [k, f"{100 * w / sum(row):.1f}%"] for k, w in enumerate(row) if k not in (0, 14)
    ]
    assert "the sinks set aside" in page.text_content("#weights-title")

    toggle.uncheck()  # back to the raw weights
    assert sorted(map(tuple, _drawn(page))) == _expected(data["weights"], 3, [3], focus)
    assert "hidden-sink" not in page.get_attribute("#key-0", "class")
    assert errors == []
    page.close()

    # a page written with hide_sinks=True opens with them hidden
    hidden = tmp_path / "hidden.html"
    save_head_view(hidden, weights, tokens, special=[t in ("[CLS]", "[SEP]") for t in tokens],
                   focus=focus, hide_sinks=True)  # fmt: skip
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(hidden.as_uri())
    page.wait_for_selector("line.attn")
    assert page.locator("#hide-sinks").is_checked()
    assert not {d[2] for d in _drawn(page)} & {0, 14}
    page.close()


def test_head_view_sinks_must_match_the_weights():
    from multihead.inspect import find_sinks

    w = torch.rand(1, 2, 3, 3).softmax(-1)
    other = find_sinks(torch.rand(2, 2, 3, 3).softmax(-1))
    with pytest.raises(ValueError, match=r"sinks must be those of these weights: 1 layers x 2"):
        head_view(w, ["a", "b", "c"], sinks=other)

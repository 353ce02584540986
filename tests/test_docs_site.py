"""The documentation site opened from disk (file://) in Debian's headless Chromium, offline: every
navigation link opens its page (not a folder listing) and the search box finds pages, with no
request leaving the disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built as `make docs` builds it, into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.fixture
def page(browser):
    """A page that records every request and every error, and refuses anything not on disk."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.requests, page.errors = [], []
    page.on("request", lambda r: page.requests.append(r.url))
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.route(
        "**/*",
        lambda route: route.continue_() if route.request.url.startswith("file:") else route.abort(),
    )
    yield page
    page.close()


def test_every_link_of_the_navigation_opens_its_page(site, page):
    page.goto((site / "index.html").as_uri())
    links = page.eval_on_selector_all(
        "nav.md-nav--primary a.md-nav__link[href]", "els => els.map(e => e.href)"
    )
    pages = sorted({link.split("#")[0] for link in links})
    assert len(pages) >= 20  # the nav of mkdocs.yml: guides, design, reference pages
    for url in pages:
        assert url.startswith("file://") and url.endswith(".html"), url
        page.goto(url)
        assert page.locator("article h1").count() == 1, url  # a page, not a folder listing

    # clicking through, as a reader does
    page.goto((site / "index.html").as_uri())
    page.click("nav.md-nav--primary >> text=Getting started")
    assert page.url == (site / "getting-started.html").as_uri()
    assert page.locator("article h1").inner_text().strip("¶ \n") == "Getting started"
    page.click("nav.md-nav--primary >> text=Masks >> nth=0")
    assert page.url == (site / "guides" / "masks.html").as_uri()
    assert all(url.startswith("file://") for url in page.requests), page.requests
    assert page.errors == []


def test_search_works_from_disk(site, page):
    page.goto((site / "guides" / "masks.html").as_uri())
    page.click("label.md-search__icon, .md-search__input")
    # typed key by key, as a reader does: the theme searches on keyup (and once more when its
    # index is ready), not on the input event alone that fill() sends
    page.locator("input.md-search__input").press_sequentially("sliding_window")
    page.wait_for_selector(".md-search-result__item", timeout=60_000)
    first = page.locator(".md-search-result__item a").first
    href = first.get_attribute("href")
    assert href is not None and ".html" in href
    first.click()
    page.wait_for_load_state()
    assert page.url.startswith("file://") and ".html" in page.url
    assert "sliding_window" in page.locator("article").inner_text()
    assert all(url.startswith("file://") for url in page.requests), page.requests
    assert page.errors == []

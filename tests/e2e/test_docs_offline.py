"""The control plane's /docs and /redoc as a person opens them on a machine without internet: the real
server (``python -m api``), Debian's Chromium driven by Playwright, every request that is not to
127.0.0.1 refused. The pages must render every operation of the OpenAPI document from the service's
own files (FastAPI's default pages load theirs from a CDN, and stay blank offline).

    python -m pytest -q tests/e2e/test_docs_offline.py

Needs /usr/bin/chromium and the playwright package, as tests/e2e/test_mlflow_ui.py does (it skips
without them, except under CI=true, where it fails).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import httpx
import pytest

from tests.api.api_testkit import TOKENS, Server
from tests.e2e.mlflow_ui import chromium, require_browser
from timing import scaled

NOT_LOOPBACK = re.compile(r"^https?://(?!127\.0\.0\.1[:/])")
# ReDoc's menu shows Redocly's logo from their CDN and drops the <img> when it fails to load: the one
# outside request a page may make (and it is refused here).
REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    """A queue-only server (capacity 0: nothing runs) with its own workspace and stores."""
    require_browser()  # before the server starts: a skip costs nothing
    root = tmp_path_factory.mktemp("docs-offline")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MESHFLOW_WORKSPACE": str(root / "workspace"),
           "MESHFLOW_DATABASE_URL": f"sqlite:///{root / 'jobs.db'}",
           "MESHFLOW_MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
           "MESHFLOW_TOKENS": json.dumps(TOKENS), "MESHFLOW_CAPACITY": "0"}
    server = Server(root=root, env=env).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def operations(server) -> dict[tuple[str, str], str]:
    """``{(METHOD, path): summary}`` of every operation in the server's OpenAPI document."""
    document = httpx.get(f"{server.url}/openapi.json", timeout=scaled(60)).json()
    return {(method.upper(), path): op["summary"] for path, ops in document["paths"].items() for method,
            op in ops.items()}


@pytest.fixture
def offline_page(server) -> Iterator[tuple[object, list[str]]]:
    """A page in a fresh browser profile whose requests off 127.0.0.1 are aborted; and the list of
    those refused URLs."""
    from playwright.sync_api import expect

    refused: list[str] = []
    with chromium() as browser:
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(scaled(60_000))
        expect.set_options(timeout=scaled(60_000))
        context.route(NOT_LOOPBACK, lambda route: (refused.append(route.request.url), route.abort()))
        try:
            yield context.new_page(), refused
        finally:
            context.close()


def test_swagger_ui_renders_every_operation_without_network(server, operations, offline_page):
    from playwright.sync_api import expect

    page, refused = offline_page
    page.goto(f"{server.url}/docs")
    blocks = page.locator(".opblock")
    expect(blocks).to_have_count(len(operations))  # one block per operation, once the document is rendered
    create = page.locator(".opblock-post", has=page.locator(".opblock-summary-path",
                                                            has_text=re.compile(r"^/v1/jobs$")))
    expect(create.locator(".opblock-summary-description")).to_have_text(operations["POST", "/v1/jobs"])
    shown = {(block.locator(".opblock-summary-method").inner_text(),
              block.locator(".opblock-summary-path").inner_text().replace("\u200b", ""))  # Swagger UI's break hints
             for block in blocks.all()}
    assert shown == set(operations), shown
    assert page.title() == "Meshflow control plane - Swagger UI"
    assert refused == []  # every script, style sheet and icon came from the service


def test_redoc_renders_every_operation_without_network(server, operations, offline_page):
    from playwright.sync_api import expect

    page, refused = offline_page
    page.goto(f"{server.url}/redoc")
    headings = page.locator("h2")
    expect(headings.filter(has_text=operations["POST", "/v1/jobs"])).to_have_count(1)
    summaries = [text for text in headings.all_inner_texts() if text in set(operations.values())]
    assert sorted(summaries) == sorted(operations.values())
    assert page.title() == "Meshflow control plane - ReDoc"
    assert set(refused) <= {REDOC_LOGO}, refused

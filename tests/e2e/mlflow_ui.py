"""The MLflow UI in headless Chromium, for tests: an ``mlflow server`` of their own, Debian's
Chromium driven by Playwright, and the checks a person makes on a run page.

Used by ``tests/e2e/test_mlflow_ui.py``:

    python -m pytest -q tests/e2e/test_mlflow_ui.py
    MESHFLOW_SCREENSHOT_DIR=docs python -m pytest -q tests/e2e/test_mlflow_ui.py -k 3d   # docs/tracking.md's pictures

Chromium is Debian's (``apt-get install chromium``; ``.ci/run`` installs it), never Playwright's
download (``playwright install`` fetches from a CDN this machine cannot reach): Playwright's Python
package drives whatever executable it is given.

Which view MLflow 3.17's UI shows is a per-browser choice, not the experiment's: the sidebar's
"GenAI | Model training" switch, remembered in the browser's localStorage (GenAI by default) and
overridden by ``?workflowType=machine_learning`` in the URL. The ``mlflow.experimentKind`` tag is
ignored by this UI version (its bundle reads the tag only when workflow navigation is off, and it is
hard-wired on), so the run page is opened with that URL parameter, as a link to it must be written.
"""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ports import free_port
from timing import Deadline, scaled

CHROMIUM = Path("/usr/bin/chromium")
# Playwright adds --headless and a fresh temporary --user-data-dir itself. Without the
# background-networking flags Chromium keeps calling Google's hosts, which this closed network refuses.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MODEL_TRAINING = "machine_learning"  # the UI's name for its "Model training" view
# Sidebar links of each view: the model-training view lists runs and models, the GenAI view
# traces, sessions, judges and evaluation runs.
MODEL_TRAINING_LINKS = ("Runs", "Models", "Model registry")
GENAI_ONLY_LINKS = ("Sessions", "Judges", "Evaluation runs")
UI_TIMEOUT_MS = 60_000  # first load of the UI bundle takes 5-10 s on a busy 2-core machine


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def require_browser() -> None:
    """Skip (fail under ``CI=true``, where ``.ci/run`` installs them) without Chromium or Playwright."""
    missing = []
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"{CHROMIUM} (Debian's chromium: apt-get install -y --no-install-recommends chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append('the playwright package (pip install -e ".[dev]")')
    if missing:
        reason = "the browser tests need " + " and ".join(missing)
        if in_ci():
            pytest.fail(reason + "; .ci/run installs both, so under CI=true this is an error", pytrace=False)
        pytest.skip(reason)


# ------------------------------------------------------------------------------ server


@dataclass(frozen=True)
class MlflowServer:
    url: str  # http://127.0.0.1:<port>, also the tracking URI
    log: Path  # the server's stdout and stderr

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


@contextmanager
def mlflow_server(root: Path, *, backend_store_uri: str | None = None,
                  startup_timeout: float = 120) -> Iterator[MlflowServer]:
    """``mlflow server`` on a free loopback port, with its store (SQLite under ``root`` unless
    ``backend_store_uri`` names another, e.g. ``postgresql+psycopg://...``) and artifacts under ``root``.

    Artifacts are served through the server (``--serve-artifacts``: clients upload and the UI
    downloads over HTTP, new experiments get ``mlflow-artifacts:/`` roots stored in
    ``--artifacts-destination``), as in the deployment; one worker keeps the 2-core machine free.
    The server runs in its own process group, which is killed on exit."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = root / "mlflow-server.log"
    command = [sys.executable, "-m", "mlflow", "server",
               "--backend-store-uri", backend_store_uri or f"sqlite:///{root / 'mlflow.db'}",
               "--serve-artifacts", "--artifacts-destination", str(root / "artifacts"),
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    env = {**os.environ,
           # No usage reports from a test (MLflow skips them under CI and pytest too; this says it outright).
           "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
           # The server's job runner (GenAI scorers, periodic trace jobs) starts seven huey consumer
           # processes of ~250 MB each; nothing here uses it.
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=root, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    server = MlflowServer(url=url, log=log)
    try:
        _wait_healthy(proc, server, startup_timeout)
        yield server
    finally:
        _stop_group(proc)


def _wait_healthy(proc: subprocess.Popen, server: MlflowServer, timeout: float) -> None:
    """Until /health answers 200 or the server exits; ``timeout`` scaled (tests/timing.py)."""
    deadline = Deadline(timeout)
    while not deadline.expired():
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with code {proc.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=scaled(2)) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"mlflow server not healthy after {deadline.seconds_scaled:.0f} s:\n{server.log_tail()}")


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (uvicorn and its workers), SIGKILL after 15 s."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=scaled(wait))
            return
        except subprocess.TimeoutExpired:
            continue


# ----------------------------------------------------------------------------- browser


@contextmanager
def chromium() -> Iterator:
    """Debian's Chromium, headless, as a Playwright ``Browser``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def ui_page(browser, *, width: int = 1400, height: int = 1000) -> Iterator:
    """A page in a fresh browser profile (a new user: no remembered view) that reaches only loopback."""
    from playwright.sync_api import expect

    context = browser.new_context(viewport={"width": width, "height": height})
    context.set_default_timeout(scaled(UI_TIMEOUT_MS))  # actions (goto, click) ...
    expect.set_options(timeout=scaled(UI_TIMEOUT_MS))  # ... and assertions, whose own default is 5 s
    # The UI links to mlflow.org and starts a telemetry worker; nothing outside this machine is
    # fetched, so a test never waits on (or reports to) the network.
    context.route(re.compile(r"^https?://(?!127\.0\.0\.1[:/]|localhost[:/])"), lambda route: route.abort())
    # The "MLflow Assistant" panel opens itself on a first visit and covers a third of the page;
    # start with it closed (only the screenshots care: a renamed key just leaves it open).
    context.add_init_script("localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');"
                            "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');")
    try:
        yield context.new_page()
    finally:
        context.close()


def run_page_url(server_url: str, experiment_id: str, run_id: str, *, view: str | None = MODEL_TRAINING) -> str:
    """The run page in the model-training view (see the module docstring for why the parameter);
    ``view=None``: in whichever view the browser last chose."""
    url = f"{server_url}/#/experiments/{experiment_id}/runs/{run_id}"
    return f"{url}?workflowType={view}" if view else url


def screenshot(page, path: Path, *, max_height: int = 4000) -> Path:
    """A picture of everything the page shows, ``path``.

    MLflow's pages scroll inside a panel, so Playwright's ``full_page`` sees one viewport: the
    viewport is made as tall as that panel needs (the tallest scrolling element; tables inside it
    scroll on their own and keep their height), the picture is cut below the panel's last content,
    and the viewport is restored."""
    size = page.viewport_size
    overflow = page.evaluate("""() => {
        const scrolling = Array.from(document.querySelectorAll('*')).filter(e => e.scrollHeight > e.clientHeight
            && ['auto', 'scroll'].includes(getComputedStyle(e).overflowY));
        const panel = scrolling.sort((a, b) => b.clientHeight - a.clientHeight)[0];
        if (!panel) return 0;
        panel.setAttribute('data-screenshot-panel', '');
        return panel.scrollHeight - panel.clientHeight;
    }""")
    path.parent.mkdir(parents=True, exist_ok=True)
    page.set_viewport_size({"width": size["width"], "height": min(size["height"] + overflow, max_height)})
    try:
        page.wait_for_timeout(500)  # let the layout settle at the new size
        bottom = page.evaluate("""() => {
            const panel = document.querySelector('[data-screenshot-panel]');
            if (!panel) return window.innerHeight;
            panel.removeAttribute('data-screenshot-panel');
            // The lowest text, picture or icon that shows: containers and dividers stretch to the
            // panel's height, and the rows of a table that scrolls on its own end where it ends.
            const shown = e => {
                let bottom = e.getBoundingClientRect().bottom;
                for (let a = e.parentElement; a && a !== panel; a = a.parentElement)
                    if (getComputedStyle(a).overflowY !== 'visible')
                        bottom = Math.min(bottom, a.getBoundingClientRect().bottom);
                return bottom;
            };
            const leaves = Array.from(panel.querySelectorAll('*')).filter(e => e.childElementCount === 0
                && e.getBoundingClientRect().height > 0
                && (e.textContent.trim() || ['IMG', 'CANVAS', 'INPUT', 'path'].includes(e.tagName)));
            return leaves.length ? Math.max(...leaves.map(shown)) : window.innerHeight;
        }""")
        height = min(int(bottom) + 24, page.viewport_size["height"])
        page.screenshot(path=str(path), clip={"x": 0, "y": 0, "width": size["width"], "height": height})
    finally:
        page.set_viewport_size(size)
    return path


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's header."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


# -------------------------------------------------------------------------- run page


def check_run_page(page, server_url: str, *, experiment_id: str, experiment_name: str, run_id: str,
                   run_name: str, tags: Mapping[str, str], picture: str, picture_size: tuple[int, int],
                   out_dir: Path) -> dict[str, Path]:
    """Open the run page as a person would and check what they look for: the model-training view,
    the run's name and tags on its overview, and ``picture`` (an artifact path) shown from the
    Artifacts tab at its real size. Screenshots (``overview.png``, ``artifact.png`` in ``out_dir``)
    are taken before each part's assertions, so a failure leaves the picture of what was shown."""
    from playwright.sync_api import expect

    shots: dict[str, Path] = {}
    page.goto(run_page_url(server_url, experiment_id, run_id))
    header = page.get_by_test_id("runs-header")  # the run's name at the top of its page
    expect(header, "the run's name at the top of its page").to_have_text(run_name)
    tag_section = page.locator("div").filter(has=page.get_by_role("heading", name="Tags", exact=True)).last
    expect(tag_section, "the Tags section").to_contain_text(next(iter(tags)))  # filled in after the header
    shots["overview"] = screenshot(page, out_dir / "overview.png")

    expect_model_training_view(page, experiment_id, experiment_name)
    for key, value in tags.items():  # each tag is a chip reading "key: value"
        expect(tag_section, f"tag {key}").to_contain_text(f"{key}: {value}")

    page.get_by_role("tab", name="Artifacts", exact=True).click()
    folder, _, name = picture.rpartition("/")
    for part in [*filter(None, folder.split("/")), name]:  # expand the folders, then open the file
        node = page.locator(f'[data-testid="artifact-tree-node"][aria-label="{part}"]')
        expect(node, f"{part!r} of {picture} in the artifact tree").to_be_visible()
        node.click()
    image = page.get_by_alt_text(picture, exact=True)  # the preview's alt text is the artifact path
    expect(image, f"the preview of {picture}").to_be_visible()
    image.evaluate("img => img.decode()")  # resolves once the image is decoded and ready to paint
    shots["artifact"] = screenshot(page, out_dir / "artifact.png")
    shown = tuple(image.evaluate("img => [img.naturalWidth, img.naturalHeight]"))
    assert shown == tuple(picture_size), f"{picture} shown at {shown}, the file is {picture_size}"
    return shots


def expect_model_training_view(page, experiment_id: str, experiment_name: str) -> None:
    """The page is MLflow's model-training view of the experiment, not its GenAI view: the sidebar
    offers runs, models and the model registry and none of the GenAI pages, and the breadcrumb
    leads to the experiment's runs."""
    from playwright.sync_api import expect

    for name in MODEL_TRAINING_LINKS:
        expect(page.get_by_role("link", name=name, exact=True).first,
               f"the model-training view's link {name!r}").to_be_visible()
    expect(page.get_by_role("link", name="Runs", exact=True).first,
           "the link to the experiment's runs").to_have_attribute("href",
                                                                  re.compile(rf"#/experiments/{experiment_id}/runs\b"))
    for name in GENAI_ONLY_LINKS:
        expect(page.get_by_role("link", name=name, exact=True), f"the GenAI view's link {name!r}").to_have_count(0)
    expect(page.get_by_test_id("experiment-runs-link"),
           "the experiment in the breadcrumb").to_have_text(experiment_name)

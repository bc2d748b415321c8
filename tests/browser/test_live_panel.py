"""A person's view: JupyterLab in Debian's Chromium, driven by Playwright.

Runs a ``%%distrain`` cell in a real JupyterLab and reads the page: the live panel's step grows
while the cell trains, Stop (which asks the server to interrupt the kernel) stops every rank, and
the final figure and summary appear. Screenshots go
to ``build/browser/``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

pytestmark = [pytest.mark.browser, pytest.mark.cluster, pytest.mark.torch, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = Path(__file__).parents[2] / "build" / "browser"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CELL = """%%distrain -n 2 --framework torch
import time
model = nn.parallel.DistributedDataParallel(nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(100_000):
    x = torch.randn(32, 16)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.01)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    if CHROMIUM is None:
        pytest.skip("no Chromium found: install Debian's chromium (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser needed)")
    pytest.importorskip("jupyterlab", reason="pip install jupyterlab")
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("%load_ext nbdist"), nbformat.v4.new_code_cell(CELL)]
    )
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, tmp_path / "panel.ipynb")
    port, token = _free_port(), "nbdist-browser-test"
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={tmp_path}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail("JupyterLab did not start on loopback within 60 s")
            time.sleep(0.5)
    yield base, token
    # Shut the kernels down the way JupyterLab does, so nbdist's exit handling runs.
    kernels = json.load(urllib.request.urlopen(f"{base}/api/kernels?token={token}"))
    for k in kernels:
        req = urllib.request.Request(f"{base}/api/kernels/{k['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(req, timeout=30)
    server.terminate()
    server.wait(timeout=30)


def _step_of_rank0(page) -> int:
    text = page.locator(".jp-OutputArea table tr:nth-child(2) td:nth-child(3)").first.inner_text()
    return int(text) if text.strip() else -1


def test_panel_updates_and_stop_ends_the_run(lab):
    from playwright.sync_api import sync_playwright

    base, token = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.goto(f"{base}/lab/tree/panel.ipynb?token={token}")
        page.locator(".jp-Notebook .jp-Cell").first.click(timeout=60_000)
        page.wait_for_selector(
            ".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000
        )
        page.keyboard.press("Shift+Enter")
        page.keyboard.press("Shift+Enter")

        page.wait_for_selector(".jp-OutputArea table", timeout=120_000)
        deadline = time.monotonic() + 120
        while _step_of_rank0(page) < 1:
            assert time.monotonic() < deadline, "the panel never showed a step"
            time.sleep(0.5)
        first = _step_of_rank0(page)
        time.sleep(3)
        second = _step_of_rank0(page)
        page.screenshot(path=str(SHOTS / "1_training.png"))
        assert second > first, f"the step shown did not grow: {first} then {second}"

        clicked = time.monotonic()
        page.get_by_role("button", name="Stop").click()
        try:
            page.get_by_text("stopped ranks 0, 1").wait_for(timeout=30_000)
        except Exception:
            page.screenshot(path=str(SHOTS / "2_stop_timed_out.png"))
            button = page.locator(".jp-OutputArea button").last.inner_text()
            outputs = page.locator(".jp-Cell").nth(1).locator(".jp-OutputArea").inner_text()
            (SHOTS / "2_stop_timed_out.txt").write_text(outputs)
            pytest.fail(
                f"no 'stopped ranks' 30 s after Stop; the button says {button!r}; the cell's "
                f"outputs end with: {outputs[-3000:]}"
            )
        stopped_after = time.monotonic() - clicked
        page.get_by_text("nbdist: final loss").wait_for(timeout=30_000)
        page.screenshot(path=str(SHOTS / "2_stopped.png"))
        # One figure: the static one took the live widgets' place (its own image included).
        outputs = page.locator(".jp-Cell").nth(1).locator(".jp-OutputArea")
        assert outputs.locator(".jp-RenderedImage img").count() == 1
        assert outputs.locator("img").count() == 1
        assert outputs.locator(".jupyter-widgets").count() == 0
        assert stopped_after < 10
        browser.close()

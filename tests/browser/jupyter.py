"""A real Jupyter front end for the browser tests: a server on loopback (JupyterLab or Notebook 7)
with a notebook in a temporary folder, and Debian's Chromium driven by Playwright.

``Jupyter`` starts the server; ``open_notebook`` loads a notebook in the page and waits for its
kernel; ``run_cell`` types Shift+Enter on a cell; ``save`` saves it the way a person does (the
server writes it, and validates it as it does). Both front ends share the cell markup
(``.jp-Cell``, ``.jp-OutputArea``): Notebook 7 is built from JupyterLab's components.
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
from typing import Any

import nbformat

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
TOKEN = "nbdist-browser-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_notebook(path: Path, sources: list[str]) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, path)
    return path


class Jupyter:
    """A Jupyter server (``app``: "lab" or "notebook") serving ``root`` on loopback."""

    def __init__(self, root: Path, app: str = "lab") -> None:
        self.root, self.app = root, app
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        module = "jupyterlab" if app == "lab" else "notebook"
        env = {**os.environ, "JUPYTER_CONFIG_DIR": str(root / ".config")}
        self.log = open(root / f"{app}-server.log", "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                "--no-browser",
                "--allow-root",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={self.port}",
                f"--IdentityProvider.token={TOKEN}",
                f"--ServerApp.root_dir={root}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.base}/api/status?token={TOKEN}", timeout=2)
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(
                        f"Jupyter ({module}) did not start on loopback in 60 s"
                    ) from None
                time.sleep(0.5)

    def url(self, name: str) -> str:
        path = "lab/tree" if self.app == "lab" else "notebooks"
        return f"{self.base}/{path}/{name}?token={TOKEN}"

    def api(self, path: str, method: str = "GET") -> Any:
        req = urllib.request.Request(f"{self.base}/api/{path}?token={TOKEN}", method=method)
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def server_log(self) -> str:
        self.log.flush()
        return (self.root / f"{self.app}-server.log").read_text(errors="replace")

    def stop(self) -> None:
        """Shut the kernels down as the front end does (nbdist's exit handling runs), then the
        server."""
        if self.process.poll() is None:
            try:
                for k in self.api("kernels"):
                    self.api(f"kernels/{k['id']}", method="DELETE")
            except OSError:
                pass
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def launch(playwright: Any) -> Any:
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


def open_notebook(page: Any, server: Jupyter, name: str) -> None:
    """Load the notebook and wait until its kernel is idle, the first cell selected."""
    page.goto(server.url(name))
    page.locator(".jp-Notebook .jp-Cell").first.click(timeout=60_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)


def cell(page: Any, index: int) -> Any:
    return page.locator(".jp-Notebook .jp-Cell").nth(index)


def outputs(page: Any, index: int) -> Any:
    return cell(page, index).locator(".jp-OutputArea")


def run_cell(page: Any, index: int, *, wait: bool = True, timeout: float = 180) -> None:
    """Select cell ``index`` and run it with Shift+Enter; with ``wait``, until the kernel is idle
    again (its prompt shows a number, not ``*``)."""
    cell(page, index).locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")
    page.keyboard.press("Shift+Enter")
    if wait:
        wait_idle(page, index, timeout)


def wait_idle(page: Any, index: int, timeout: float = 180) -> None:
    prompt = cell(page, index).locator(".jp-InputPrompt")
    deadline = time.monotonic() + timeout
    while True:
        text = prompt.inner_text().strip()
        if text and "*" not in text and text != "[ ]:":
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"cell {index} still runs after {timeout:.0f} s ({text!r})")
        time.sleep(0.25)


def save(page: Any) -> None:
    """Ctrl+S, as a person saves, and wait until the server has written it."""
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    page.wait_for_timeout(1500)

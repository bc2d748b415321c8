"""A person's view: JupyterLab and Notebook 7 in Debian's Chromium, driven by Playwright.

Runs a ``%%distrain`` cell in a real front end and reads the page: the live panel's step grows
while the cell trains and its figure keeps up with its table (redrawn within one update of
it), Stop (which asks the server to interrupt the kernel) stops every rank after the same step,
the final figure takes the live one's place at the same size, the summary and the Stop message
name the same step, the next cell finds the replicas identical, a cell that fails is named as
the notebook numbers it (``Cell In[4], line 3``), ``%distrain debug`` prompts ``(rank 1) Pdb``
in the notebook's input box and answers the pdb commands typed there, as does a rank paused at
``breakpoint()``, and the notebook, saved
as a person saves it, is valid. Screenshots go to ``build/browser/``.
"""

from __future__ import annotations

import re
import time

import nbformat
import pytest

from tests.browser.jupyter import (
    CHROMIUM,
    SHOTS,
    Jupyter,
    cell,
    launch,
    open_notebook,
    outputs,
    run_cell,
    save,
    wait_idle,
    write_notebook,
)

pytestmark = [pytest.mark.browser, pytest.mark.cluster, pytest.mark.torch, pytest.mark.slow]

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


@pytest.fixture(params=["lab", "notebook"], ids=["jupyterlab", "notebook7"])
def front_end(request, tmp_path):
    if CHROMIUM is None:
        pytest.skip("no Chromium found: install Debian's chromium (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser needed)")
    pytest.importorskip("jupyterlab" if request.param == "lab" else "notebook")
    write_notebook(
        tmp_path / "panel.ipynb",
        [
            "%load_ext nbdist", CELL, "%distrain compare model", FAILING, "%distrain debug",
            BREAKPOINT,
        ],  # fmt: skip
    )
    server = Jupyter(tmp_path, request.param)
    yield server
    server.stop()


FAILING = "%%distrain\nif rank == 1:\n    raise ValueError('bad batch')\n"
BREAKPOINT = "%%distrain\nx = rank * 10\nif rank == 1:\n    breakpoint()\ny = x + 1\n"

# Records, in the page, when the panel's table and its image change (ms since the page's start).
WATCH = """() => {
  const out = document.querySelectorAll('.jp-OutputArea')[1];
  const table = out.querySelector('table'), img = out.querySelector('img');
  window.nbdistChanges = {table: [], image: []};
  new MutationObserver(() => window.nbdistChanges.table.push(performance.now()))
    .observe(table.parentElement, {childList: true, subtree: true, characterData: true});
  new MutationObserver(() => window.nbdistChanges.image.push(performance.now()))
    .observe(img, {attributes: true, attributeFilter: ['src']});
}"""


def _lag_s(changes: dict[str, list[float]]) -> float:
    """The longest the figure stayed behind a table update: for each table change, the time to
    the first figure change at or after it (they are drawn together: each update changes both)."""
    lags = []
    for t in changes["table"]:
        later = [i for i in changes["image"] if i >= t - 50]  # the same update, in either order
        if later:
            lags.append(max(0.0, min(later) - t))
    assert lags, changes
    return max(lags) / 1000


def _step_of_rank0(page) -> int:
    text = page.locator(".jp-OutputArea table tr:nth-child(2) td:nth-child(3)").first.inner_text()
    return int(text) if text.strip() else -1


def _type_into_pdb(page, index: int, typed_in, shot) -> str:
    """Run cell ``index``, answer each ``(rank 1) Pdb`` prompt in its input box with the next
    line of ``typed_in`` (``(line, answer expected or None)``), and return the cell's output
    once it ends; a screenshot once the first answer shows."""
    run_cell(page, index, wait=False)
    out = outputs(page, index)
    for asked, (typed, answer) in enumerate(typed_in):
        # Each prompt is a new input box; the answered ones stay above it.
        box = out.locator("input.jp-Stdin-input").nth(asked)
        box.wait_for(timeout=60_000)
        prompt = out.locator(".jp-Stdin-prompt").last.inner_text()
        assert prompt.startswith("(rank 1) Pdb"), out.inner_text()
        box.fill(typed)
        box.press("Enter")
        if answer is not None:
            out.get_by_text(answer).wait_for(timeout=30_000)
            page.screenshot(path=str(shot))
    wait_idle(page, index, timeout=60)
    return out.inner_text()


def test_panel_updates_stop_ends_the_run_and_the_saved_notebook_is_valid(front_end):
    from playwright.sync_api import sync_playwright

    app = front_end.app
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = launch(p)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        open_notebook(page, front_end, "panel.ipynb")
        run_cell(page, 0)
        run_cell(page, 1, wait=False)

        page.wait_for_selector(".jp-OutputArea table", timeout=120_000)
        deadline = time.monotonic() + 120
        while _step_of_rank0(page) < 1:
            assert time.monotonic() < deadline, "the panel never showed a step"
            time.sleep(0.5)
        first = _step_of_rank0(page)
        page.evaluate(WATCH)
        time.sleep(4)
        second = _step_of_rank0(page)
        page.screenshot(path=str(SHOTS / f"{app}_1_training.png"))
        assert second > first, f"the step shown did not grow: {first} then {second}"
        # The figure keeps up with the table: redrawn with it, never an update behind (at most
        # 2 s apart when drawing is slow, FIGURE_MAX_AGE_S).
        changes = page.evaluate("() => window.nbdistChanges")
        assert len(changes["image"]) >= 2, changes
        assert _lag_s(changes) < 1.0, changes
        live_width = outputs(page, 1).locator("img").evaluate(
            "img => img.getBoundingClientRect().width"
        )

        stop = page.get_by_role("button", name="Stop after this step")
        clicked = time.monotonic()
        stop.click()
        try:
            page.get_by_text("every rank stopped after step").wait_for(timeout=30_000)
        except Exception:
            page.screenshot(path=str(SHOTS / f"{app}_2_stop_timed_out.png"))
            button = page.locator(".jp-OutputArea button").last.inner_text()
            text = outputs(page, 1).inner_text()
            (SHOTS / f"{app}_2_stop_timed_out.txt").write_text(text)
            pytest.fail(
                f"no 'stopped after step' 30 s after Stop; the button says {button!r}; the cell's "
                f"outputs end with: {text[-3000:]}"
            )
        stopped_after = time.monotonic() - clicked
        page.get_by_text("nbdist: final loss").wait_for(timeout=30_000)
        page.screenshot(path=str(SHOTS / f"{app}_2_stopped.png"))
        # One figure: the static one took the live widgets' place (its own image included).
        cell_outputs = outputs(page, 1)
        assert cell_outputs.locator(".jp-RenderedImage img").count() == 1
        assert cell_outputs.locator("img").count() == 1
        assert cell_outputs.locator(".jupyter-widgets").count() == 0
        # ...and it is a picture the browser could decode (a broken image has no width), shown
        # at the live figure's size: nothing jumps when it replaces the widgets.
        width = cell_outputs.locator("img").evaluate("img => img.naturalWidth")
        assert width == 864
        shown = cell_outputs.locator("img").evaluate("img => img.getBoundingClientRect().width")
        assert abs(shown - live_width) <= 2, (shown, live_width)
        assert stopped_after < 10
        said = cell_outputs.inner_text()
        assert "The workers' variables are kept" in said
        # One count of steps: the Stop message's and the summary's are the same step.
        stopped = re.search(r"every rank stopped after step (\d+) \((\d+) steps taken\)", said)
        summary = re.search(r"final loss \S+ \(step (\d+), mean over ranks\)", said)
        assert stopped and summary, said
        assert stopped.group(1) == summary.group(1), said
        assert int(stopped.group(2)) == int(stopped.group(1)) + 1
        # The model the stop kept, in the next cell: the same on both ranks.
        run_cell(page, 2)
        compared = outputs(page, 2).inner_text()
        page.screenshot(path=str(SHOTS / f"{app}_3_compared.png"))
        assert "model: identical on 2 ranks" in compared, compared
        # A cell that fails is named as the notebook numbers it, its line as the editor shows.
        run_cell(page, 3)
        failed = outputs(page, 3).inner_text()
        prompt = cell(page, 3).locator(".jp-InputPrompt").inner_text().strip()
        count = re.search(r"\d+", prompt).group(0)
        page.screenshot(path=str(SHOTS / f"{app}_4_failed.png"))
        assert f"at Cell In[{count}], line 3: raise ValueError('bad batch')" in failed, failed
        assert "To look at rank 1's variables where it raised: %distrain debug" in failed
        # %distrain debug: pdb on the rank that raised, its prompt the notebook's input box.
        typed_in = (("p 'rank is', rank", "('rank is', 1)"), ("up", None), ("q", None))
        said = _type_into_pdb(page, 4, typed_in, shot=SHOTS / f"{app}_5_debugger.png")
        assert f"> Cell In[{count}](3)<module>()" in said, said
        assert "-> raise ValueError('bad batch')" in said, said
        # breakpoint() in a cell: rank 1 pauses there and the notebook prompts for it.
        typed_in = (("p x, rank", "(10, 1)"), ("c", None))
        said = _type_into_pdb(page, 5, typed_in, shot=SHOTS / f"{app}_6_breakpoint.png")
        assert "-> y = x + 1" in said, said
        # The last input box keeps the keyboard (JupyterLab leaves the answered box focused):
        # Ctrl+S must reach the notebook, as a person's click on it does.
        page.evaluate("() => document.activeElement.blur()")
        cell(page, 5).locator(".jp-InputPrompt").click()
        save(page)
        browser.close()
    saved = nbformat.read(front_end.root / "panel.ipynb", as_version=4)
    nbformat.validate(saved)
    images = [o for o in saved.cells[1].outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1 and isinstance(images[0]["data"]["image/png"], str)
    assert "Notebook JSON is invalid" not in front_end.server_log()

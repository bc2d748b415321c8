"""What the ranks print and display reaches the cell as plain Jupyter would show it, per rank:
progress bars live, warnings once, figures once (real engines, real tqdm, matplotlib and
transformers)."""

from __future__ import annotations

import base64

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.torch]


class Spy:
    """Wraps the session's display (or publish) function and keeps what went through it."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.real(*args, **kwargs)


@pytest.fixture
def spied(fresh_session, magics, monkeypatch):
    display = Spy(magics.session.display)
    publish = Spy(magics.session.publish)
    monkeypatch.setattr(magics.session, "display", display)
    monkeypatch.setattr(magics.session, "publish", publish)
    # As in a Jupyter kernel (the test's shell is a terminal one, which would print each
    # update of the progress display on a line of its own).
    monkeypatch.setattr(magics.session, "live_progress", True)
    return fresh_session, display, publish


def _progress_texts(display):
    """The texts the progress display showed, in order (the panel's own display aside)."""
    return [
        args[0]["text/plain"]
        for args, _ in display.calls
        if args and isinstance(args[0], dict) and "text/html" in args[0]
        and args[0]["text/html"].startswith("<pre>")
    ]  # fmt: skip


def test_a_tqdm_bar_on_rank_0_updates_while_the_cell_runs(spied, capsys):
    sh, display, publish = spied
    cell = (
        "from tqdm.auto import tqdm\nimport time\n"
        "for i in tqdm(range(20), disable=rank != 0, mininterval=0):\n    time.sleep(0.1)\n"
    )
    sh.run_cell_magic("distrain", "--no-plot", cell)
    shown = _progress_texts(display)
    assert len(shown) >= 3, shown  # the bar, as it grew
    assert all(text.startswith("[rank 0] ") and "%|" in text for text in shown)
    assert len({text.split("|")[0] for text in shown}) >= 3  # different percentages
    err = capsys.readouterr().err
    assert err.count("[rank 0]  100%|") == 1 or err.count("[rank 0] 100%|") == 1, err
    assert "[rank 1]" not in err
    assert publish.calls == []  # no widget bar made on an engine, shown at the end


def test_the_same_warning_from_every_rank_is_shown_once(spied, capsys):
    sh, _, _ = spied
    cell = "import warnings\nwarnings.warn(f'shared {rank >= 0}', UserWarning)\n"
    sh.run_cell_magic("distrain", "--no-plot", cell)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "UserWarning: shared True" in line]
    assert len(lines) == 1 and lines[0].startswith("[ranks 0,1] "), err


def test_figures_a_cell_opened_are_closed_once_shown(spied):
    sh, _, publish = spied
    first = (
        "import matplotlib.pyplot as plt\nfig, ax = plt.subplots(figsize=(3, 2))\n"
        "ax.plot([1, 3, 2])\ndisplay(fig)\n"
    )
    sh.run_cell_magic("distrain", "--on 0 --no-plot", first)
    assert len(_images(publish)) == 1
    publish.calls.clear()
    second = "plt.figure(figsize=(3, 2))\nplt.plot([3, 1, 2])\nplt.show()\n"
    sh.run_cell_magic("distrain", "--on 0 --no-plot", second)
    (png,) = _images(publish)  # its own figure, not the first cell's as well
    assert base64.b64decode(png).startswith(b"\x89PNG")
    publish.calls.clear()
    # Drawn with pyplot and not shown: shown at the end, as Jupyter's inline backend does.
    sh.run_cell_magic("distrain", "--on 0 --no-plot", "plt.plot([1, 2])\n")
    assert len(_images(publish)) == 1
    publish.calls.clear()
    sh.run_cell_magic("distrain", "--on 0 --no-plot", "x = 1\n")
    assert _images(publish) == []


def _images(publish):
    return [args[0]["image/png"] for args, _ in publish.calls if "image/png" in args[0]]


def test_transformers_progress_shows_once_on_rank_0(spied, capsys):
    pytest.importorskip("transformers")
    sh, display, publish = spied
    cell = """
import tempfile
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
torch.manual_seed(0)
config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=37, max_position_embeddings=32, num_labels=2)
ids, labels = torch.randint(0, 100, (128, 16)), torch.randint(0, 2, (128,))
data = [{"input_ids": ids[i], "labels": labels[i]} for i in range(128)]
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8,
                         num_train_epochs=1, report_to=[], save_strategy="no",
                         logging_strategy="no")
Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=data).train()
"""
    sh.run_cell_magic("distrain", "-o res", cell)
    assert publish.calls == []  # no HTML progress table per rank
    err = capsys.readouterr().err
    finished = [line for line in err.splitlines() if "8/8 [" in line]
    assert len(finished) == 1 and finished[0].startswith("[rank 0] "), err
    assert not any(text.startswith("[rank 1]") for text in _progress_texts(display))
    # Its batches are counted (it calls the model with input_ids=...): throughput is measured.
    assert sum(p.get("samples", 0) for p in sh.user_ns["res"].history) == 128

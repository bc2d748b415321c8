"""What a cell shows from a worker: figures, progress bars, its value.

An engine is an IPython kernel whose outputs reach the notebook through ipyparallel: printed
text as it comes (the notebook relays it, :mod:`nbdist.kernel.relay`), ``display()`` outputs
when the cell ends. So on the engines:

* matplotlib figures display as PNG, as in a notebook, and those a cell opened are closed when
  it ends, as Jupyter's inline backend closes them: shown if the cell drew them with pyplot and
  did not show them itself, then closed, so a later ``plt.show()`` shows only its own.
* Progress bars are text. tqdm's ``tqdm.auto`` (ipykernel loaded) and transformers
  (``IPKernelApp`` in the shell's configuration) pick a widget bar in a process that looks like
  a notebook kernel, and an engine does; but a widget made on an engine can only be shown when
  the cell has ended, at 100%. A text bar rewrites its line with carriage returns, which the
  notebook shows as it changes. ``tqdm.notebook`` gives tqdm's text bar on the engines too.
* The cell's value comes back to the notebook only when it unpickles there without importing a
  framework the notebook does not otherwise need: a Keras ``History`` would import TensorFlow
  into the notebook's kernel (seconds, and TensorFlow's start-up lines in the cell); its repr is
  shown instead.
"""

from __future__ import annotations

import importlib.util
import io
import sys
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from nbdist.protocol import Packed, packer

# Unpickling a value made of these in the notebook would import them there.
NOT_INTO_THE_NOTEBOOK = frozenset({"tensorflow", "keras", "tf_keras", "jax"})


def packed(value: Any) -> Packed | None:
    """The cell's value as it goes to the notebook (:class:`~nbdist.protocol.Packed`), or None
    when it cannot go (see the module docstring): its repr is shown instead."""
    import cloudpickle

    modules: set[str] = set()

    class Spy(cloudpickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            owner = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
            modules.add(str(getattr(owner, "__module__", "")).split(".")[0])
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    try:
        packer(buffer, Spy).dump(value)
    except Exception:
        return None
    if modules & NOT_INTO_THE_NOTEBOOK:
        return None
    return Packed(buffer.getvalue())


def set_up(state: Any) -> None:
    """Once per engine, before its first cell: figures as PNG, progress bars as text."""
    if state.displays_set_up or "IPython" not in sys.modules:
        return
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return

    def png(fig: Any) -> bytes:
        from IPython.core.pylabtools import print_figure

        return print_figure(fig, "png", bbox_inches="tight")

    shell.display_formatter.formatters["image/png"].for_type_by_name(
        "matplotlib.figure", "Figure", png
    )
    shell.config.pop("IPKernelApp", None)  # see the module docstring: no widget progress bars
    _text_tqdm()
    state.displays_set_up = True


def _text_tqdm() -> None:
    """``tqdm.notebook`` (and an ``tqdm.auto`` imported before nbdist's set-up) give tqdm's
    text bar; imported here only where tqdm is installed."""
    if importlib.util.find_spec("tqdm") is None:
        return
    import tqdm.std

    for name in ("tqdm.notebook", "tqdm.autonotebook", "tqdm.auto"):
        try:
            # tqdm.autonotebook warns at import that it chose widgets: not the choice kept.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # tqdm.notebook needs ipywidgets; without it there is no widget bar
            continue
        setattr(module, "tqdm", tqdm.std.tqdm)  # noqa: B010
        setattr(module, "trange", tqdm.std.trange)  # noqa: B010


@contextmanager
def cell_figures() -> Iterator[None]:
    """Around a cell: the pyplot figures it drew and did not show are shown as it ends (when
    it succeeds), and every pyplot figure is closed.

    What was shown is what IPython formatted as PNG (``display(fig)``, ``plt.show()``), however
    the figure's PNG printer was registered (the inline backend registers its own when pyplot
    is first imported, which may be in this very cell).
    """
    from IPython.core.formatters import PNGFormatter

    shown: set[int] = set()
    real = PNGFormatter.__call__

    def formatting(self: Any, obj: Any) -> Any:
        shown.add(id(obj))
        return real(self, obj)

    PNGFormatter.__call__ = formatting  # type: ignore[method-assign]
    ok = False
    try:
        yield
        ok = True
    finally:
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is not None:
            if ok:
                from IPython.display import display

                for num in plt.get_fignums():
                    fig = plt.figure(num)
                    if id(fig) not in shown and fig.axes:
                        display(fig)
            plt.close("all")
        PNGFormatter.__call__ = real  # type: ignore[method-assign]

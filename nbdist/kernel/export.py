"""``%distrain export train.py``: the session's ``%%distrain`` cells as one standalone script.

The script does explicitly what nbdist did around the cells: it sets up the process group (or
the TensorFlow strategy) once, defines the names the cells used (``rank``, ``world_size``,
``device``, ``strategy``, ``log``, ...) and prints metrics to stdout. The cells that ran since
the last reset or restart follow in order, verbatim (failed cells are left out; a ``--fresh``
cell becomes a function of its own, an ``--on`` cell an ``if rank in ...:`` block), so the
script trains exactly as the session did: run it with ``torchrun`` (PyTorch) or with one
``TF_CONFIG`` per worker process (TensorFlow).

What is each framework's (the set-up, the command, a clean-up after the cells) comes from the
module its backend names as ``EXPORTER`` (:mod:`nbdist.kernel.export_torch`,
:mod:`nbdist.kernel.export_tf`): its ``script(ran, used, path)`` returns a :class:`Script`.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
import tempfile
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbdist.engine import backends
from nbdist.errors import ExportError
from nbdist.kernel.checks import calls
from nbdist.protocol import CellName, pack


@dataclass(frozen=True)
class Script:
    """A framework's part of the script (its backend's ``EXPORTER`` module's ``script``): the
    set-up before the cells (nbdist's ``log`` follows it, then ``after_log``; it must import
    ``sys``, which ``log`` writes with, and define ``rank``), how to run it (for the header),
    and what follows the cells."""

    setup: list[str]
    how: str
    after_log: list[str] = field(default_factory=list)
    after_cells: str = ""


@dataclass(frozen=True)
class CellRecord:
    """What ``export`` needs from one ``%%distrain`` cell that ran."""

    source: str
    framework: str
    world_size: int
    autolog: bool
    push: dict[str, Any] = field(default_factory=dict)
    strategy: str | None = None
    backend: str | None = None
    fresh: bool = False
    on: tuple[int, ...] | None = None
    kind: str = "cell"  # or "push": a %distrain push between cells (source empty)
    # The machines the ranks ran on, in rank order: (hostname, address, interface, workers).
    nodes: tuple[tuple[str, str, str | None, int], ...] = ()
    slurm_job: str | None = None  # the Slurm job the ranks ran in
    name: CellName = field(default_factory=CellName)  # as the notebook named it


_LOG = '''
_step = {}


def log(step=None, **metrics):
    """nbdist's log(...): in this script, one line per call on stdout, tagged with the rank."""
    if step is None:
        step = _step.get("n", 0)
    _step["n"] = step + 1
    values = " ".join(f"{k}={float(v):.6g}" for k, v in metrics.items())
    # One write per line: the ranks share torchrun's stdout, and print() writes the line and
    # its newline separately, so two ranks' lines could run into each other.
    sys.stdout.write(f"[rank {rank}] step {step} {values}\\n")
    sys.stdout.flush()
'''

_PUSH = """
import os
import pickle
import stat
import sys

# The notebook variables the cells were given with --push, saved next to this script. A pickle
# runs code when loaded: load only one this user owns and nobody else can write, opened once
# (never through a symbolic link) and checked on the open file.
_push_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), {name!r})
try:
    _fd = os.open(_push_path, os.O_RDONLY | os.O_NOFOLLOW)
except OSError as _e:
    sys.exit(f"cannot open {{_push_path}} ({{_e}}): it must be a file of yours, not a link")
with os.fdopen(_fd, "rb") as _f:
    _st = os.fstat(_f.fileno())
    if not stat.S_ISREG(_st.st_mode) or _st.st_uid != os.getuid():
        sys.exit(f"{{_push_path}} belongs to uid {{_st.st_uid}}, not to you: it could run "
                 "anything when loaded. Export the session again into a folder of your own.")
    if _st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        sys.exit(f"{{_push_path}} is writable by other users; check it, chmod 600 it, run again")
    _pushed = pickle.load(_f)
"""


def _calls_log(tree: ast.AST) -> bool:
    """``log(...)`` or ``nbdist.log(...)``; not ``torch.log`` or ``np.log``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "log":
                return True
            if isinstance(f, ast.Attribute) and f.attr == "log":
                if isinstance(f.value, ast.Name) and f.value.id == "nbdist":
                    return True
    return False


def _cell_code(index: int, cell: CellRecord) -> str:
    if cell.kind == "push":
        title = f"# --- %distrain push {', '.join(cell.push)} "
        return title + "-" * (93 - len(title)) + f"\nglobals().update(_pushed[{index}])\n"
    body = textwrap.dedent(cell.source).strip("\n")
    if cell.fresh:
        # A --fresh cell ran in a namespace of its own, with its --push data: its names stay
        # inside the function.
        name = f"_fresh_cell_{index}"
        params = ", ".join(cell.push)
        call = f"{name}(**_pushed[{index}])" if cell.push else f"{name}()"
        body = f"def {name}({params}):\n{textwrap.indent(body, '    ')}\n\n\n{call}"
    elif cell.push:
        body = f"globals().update(_pushed[{index}])\n" + body
    if cell.on is not None:
        ranks = ", ".join(map(str, cell.on)) + ("," if len(cell.on) == 1 else "")
        body = f"if rank in ({ranks}):\n{textwrap.indent(body, '    ')}"
    name = cell.name.label if cell.name.count is not None else f"cell {index + 1}"
    title = f"# --- {name}" + (" (--fresh)" if cell.fresh else "") + " "
    return title + "-" * (93 - len(title)) + "\n" + body + "\n"


def export_script(
    cells: Sequence[CellRecord], path: str | Path, *, force: bool = False
) -> list[Path]:
    """Write the script (and the pushed data beside it); returns the files written.

    Refuses to replace existing files unless ``force``; the pushed data is written readable
    by the user only.
    """
    if not cells:
        raise ExportError("no %%distrain cell has run since the workers were last reset")
    path = Path(path)
    ran = [c for c in cells if c.kind == "cell"]
    if not ran:
        raise ExportError("no %%distrain cell has run since the workers were last reset")
    last = ran[-1]
    frameworks = [f for f in backends.frameworks() if f in {c.framework for c in ran}]
    if len(frameworks) > 1:
        titles = " and ".join(backends.load(f).TITLE for f in frameworks)
        raise ExportError(
            f"the session ran both {titles} cells, which cannot share one script; "
            "%distrain reset, run the cells of one framework, then export"
        )
    data = path.with_name(path.stem + "_push.pkl")
    pushes = {i: c.push for i, c in enumerate(cells) if c.push}
    targets = [path, data] if pushes else [path]
    existing = [str(t) for t in targets if os.path.lexists(t)]  # a dangling link counts
    if existing and not force:
        raise ExportError(
            f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; choose "
            f"another name or add --force to replace {'it' if len(existing) == 1 else 'them'}"
        )
    written = [path]
    trees = [ast.parse(textwrap.dedent(c.source)) for c in ran]
    used = {name for name in ("init_process_group", "destroy_process_group")
            if any(any(calls(t, name)) for t in trees)}  # fmt: skip
    if any(_calls_log(t) for t in trees):
        used.add("log")
    n = last.world_size
    exporter = importlib.import_module(backends.load(last.framework).EXPORTER)
    made: Script = exporter.script(ran, used, path)
    how = made.how
    parts = [*made.setup, _LOG, *made.after_log]
    if pushes:
        # cloudpickle's: a class or function defined in the notebook goes by value (loading it
        # needs cloudpickle, which nbdist installs).
        write_new(data, pack(pushes).data, mode=0o600, replace=force)
        written.append(data)
        parts.insert(0, _PUSH.format(name=data.name))  # checked before anything else runs
    header = (  # raw: a Slurm header holds sed's backslashes
        f'r"""Exported from a %%distrain session by nbdist on {time.strftime("%Y-%m-%d")}.\n\n'
        f"{len(ran)} cell{'s' if len(ran) > 1 else ''} ran on {n} "
        f"worker{'s' if n > 1 else ''} ({last.framework}). {how}"
        '"""\n'
    )
    script = (
        header
        + "\n# --- what nbdist did before the cells "
        + "-" * 55
        + "\n"
        + "".join(parts).strip("\n")
        + "\n\n"
        + "\n".join(_cell_code(i, c) for i, c in enumerate(cells))
    )
    if made.after_cells:
        script += "\n# --- after the cells " + "-" * 72 + "\n" + made.after_cells
    write_new(path, script.encode(), mode=0o644, replace=force)
    return written


def _umask() -> int:
    """This process's umask (reading it means setting it: put back at once)."""
    current = os.umask(0o077)
    os.umask(current)
    return current


def write_new(path: Path, data: bytes, *, mode: int, replace: bool) -> None:
    """Create ``path`` with ``data``, never through a symbolic link; an existing file (or
    link) is an ExportError unless ``replace``, and then replaced in one step: a new file
    beside it, renamed over it (a link someone planted there is replaced, its target left
    alone)."""
    if not replace:
        try:
            # O_EXCL: whatever is there, even a dangling link, fails instead of being written.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        except FileExistsError:
            raise ExportError(
                f"{path} already exists; choose another name or add --force to replace it"
            ) from None
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        # As a new file gets it (os.open applies the umask): under umask 077 the script, the
        # cells' source, stays this user's alone when it replaces one too.
        os.fchmod(fd, mode & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

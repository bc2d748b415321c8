"""Where a rank's cell is, told to the notebook while the cell runs.

A rank blocked in a collective releases the GIL, so a thread can read the main thread's stack
(``sys._current_frames``) while the engine itself cannot answer the notebook. Every
``SAMPLE_S`` this module's thread looks at the cell's innermost line and the collective called
from it, and publishes the place once it has stayed there for two samples: a rank that stalls
has told the notebook where it waits (``"line 12: loss.backward()"``, "DDP's gradient
all-reduce in backward()", ``"torch.distributed.barrier"``), and the notebook can tell a rank
that waits for peers that finished from ranks that sit in different collectives.

The value goes under one key, ``WHERE_KEY``: ``publish_data``'s latest-value semantics are
right for it.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from nbdist.engine import ticker
from nbdist.protocol import WHERE_KEY, Waiting

SAMPLE_S = 0.5

# Functions that wait for every rank, by the file they live in: torch.distributed's collectives,
# and autograd's engine, where DDP's gradient all-reduce runs (inside backward()).
_C10D = "torch/distributed/distributed_c10d.py"
_AUTOGRAD = "torch/autograd/"
_DEBUGGER = ("bdb.py", "pdb.py")  # a rank paused at breakpoint() (nbdist.engine.breakpoints)


def place(frame: Any, filename: str) -> Waiting | None:
    """The cell line the stack under ``frame`` is at, and the collective it waits in if any;
    None when the cell's code is not on the stack (set-up, clean-up)."""
    stack = traceback.extract_stack(frame)
    cells = [i for i, f in enumerate(stack) if f.filename == filename]
    if not cells:
        return None
    at = stack[cells[-1]]
    inner = stack[cells[-1] + 1 :]
    collective = None
    c10d = [f for f in inner if f.filename.replace("\\", "/").endswith(_C10D)]
    if c10d:
        collective = f"torch.distributed.{c10d[-1].name}"
    elif any(_AUTOGRAD in f.filename.replace("\\", "/") for f in inner):
        collective = "DDP's gradient all-reduce in backward()"
    elif any(f.filename.endswith(_DEBUGGER) for f in inner):
        collective = "the debugger (the notebook's prompt)"
    return Waiting(line=at.lineno or 0, line_text=(at.line or "").strip(), collective=collective)


class WhereReporter:
    """Samples the thread that runs the cell and publishes where it stays."""

    def __init__(self, publish: Callable[[dict[str, Any]], None], filename: str) -> None:
        self._publish = publish
        self._filename = filename
        self._thread_id = threading.get_ident()  # the thread that runs the cell
        self._seen: Waiting | None = None
        self._published: Waiting | None = None
        self._tick: ticker.Tick | None = None

    def start(self) -> None:
        self._tick = ticker.every(SAMPLE_S, self._sample)

    def close(self) -> None:
        """Stop sampling; nothing is published after this returns."""
        if self._tick is not None:
            self._tick.cancel()

    def _sample(self) -> None:
        frame = sys._current_frames().get(self._thread_id)
        now = place(frame, self._filename) if frame is not None else None
        del frame
        if now is not None and now == self._seen and now != self._published:
            self._publish({WHERE_KEY: replace(now, flight=flight())})
            self._published = now
        self._seen = now


def flight() -> str | None:
    """The last collective torch's flight recorder saw this rank enter, ``"#12
    gloo:all_reduce"`` (its state too where the backend keeps one: NCCL's "started"); None
    where torch records none (``TORCH_FR_BUFFER_SIZE`` unset when the group was made, an older
    torch) or no group is up. Comparing the ranks' numbers shows which one is behind."""
    dist = sys.modules.get("torch.distributed")
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if dist is None or c10d is None or not dist.is_initialized():
        return None
    dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(
        c10d, "_dump_nccl_trace_json", None
    )
    if dump is None:
        return None
    try:
        entries = json.loads(dump(True, False)).get("entries") or []
    except Exception:  # noqa: BLE001 - no record to read: the place is still worth saying
        return None
    if not entries:
        return None
    last = entries[-1]
    state = last.get("state")
    said = f"#{last.get('collective_seq_id')} {last.get('profiling_name')}"
    return said if state in (None, "scheduled") else f"{said} ({state})"

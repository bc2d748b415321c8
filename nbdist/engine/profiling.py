"""``%%distrain --profile``: ``torch.profiler`` over a window of optimizer steps, on each rank.

The window is counted in optimizer steps (a global post-hook calls the profiler's ``step()``):
the first :data:`SKIP_STEPS` are left out (the first step builds DDP's buckets and warms the
allocator; the next is the profiler's own warm-up), then ``steps`` are recorded. Before and
after the window the profiler records nothing, so the rest of the cell runs at its normal
speed. When the window closes, this rank's part of the picture is made here, where the events
are (the notebook only combines the ranks):

* ``steps``: each profiled step's interval on the rank's own clock (microseconds);
* ``compute``: the union of the intervals in which the rank computed: on CPU its operators
  (``aten::mm``; not ranges such as ``DistributedDataParallel.forward``, which would count a
  wait inside them), on CUDA the kernels; collectives and their launches left out;
* ``comm``: each collective as it ran (gloo's ``gloo:all_reduce`` on its worker thread, NCCL's
  kernels on the GPU), in the order the rank ran them; its duration includes the time it waited
  for the last peer to arrive, which the notebook splits off by comparing the ranks;
* ``top``: the operators with the most self time in the window;
* ``trace``: the Chrome trace (gzip), loadable in Perfetto or TensorBoard.

Nothing here imports torch before a profiled cell runs.
"""

from __future__ import annotations

import gzip
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

SKIP_STEPS = 2  # optimizer steps before the window: the first one, and the profiler's warm-up
TOP_OPS = 8
# How the collectives show in the events: gloo runs them on a worker thread as "gloo:all_reduce"
# and the like; NCCL's kernels run on the GPU ("ncclDevKernel_AllReduce..."); c10d's ops,
# record_param_comms and "nccl:all_reduce" are their launches on the calling thread (neither
# computation nor the collective's run).
_COMM_LAUNCH = ("c10d::", "record_param_comms", "nccl:")

# Ranges around operators that can hold a wait for a peer (DDP's forward syncing buffers, the
# autograd engine's nodes around a bucket's launch), or that are a range not an operator: the
# operators inside them count, the ranges do not. User annotations (record_function) neither.
_WRAPPERS = ("autograd::", "DistributedDataParallel", "Optimizer.", "## ")

_taken: dict[str, Any] | None = None


def is_comm(name: str) -> bool:
    """Whether an event of this name is a collective's run (not its launch)."""
    low = name.lower()
    return low.startswith("gloo:") or ("nccl" in low and not low.startswith("nccl:"))


def is_launch(name: str) -> bool:
    return name.startswith(_COMM_LAUNCH)


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def summarize(prof: Any, device: str, *, partial: bool = False) -> dict[str, Any]:
    """This rank's part of the profile from a finished ``torch.profiler.profile`` window;
    ``partial``: the cell ended inside it, and its last step (from the last optimizer step to
    the end of the cell) is not a step."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    steps = sorted(
        (e.time_range.start, e.time_range.end) for e in events if e.name.startswith("ProfilerStep")
    )
    if partial:
        steps = steps[:-1]
    cuda = device == "cuda"
    compute: list[tuple[float, float]] = []
    comm: list[tuple[str, float, float]] = []
    for e in events:
        name = e.name
        if name.startswith("ProfilerStep"):
            continue
        span = (float(e.time_range.start), float(e.time_range.end))
        on_gpu = e.device_type == DeviceType.CUDA
        if is_comm(name) and (on_gpu or not cuda):
            comm.append((name, *span))
        elif is_comm(name) or is_launch(name):
            continue
        elif cuda:
            if on_gpu:
                compute.append(span)
        elif (
            e.device_type == DeviceType.CPU
            and not getattr(e, "is_user_annotation", False)
            and not name.startswith(_WRAPPERS)
        ):
            compute.append(span)
    comm.sort(key=lambda c: c[1])
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = [
        a
        for a in prof.key_averages()
        if not a.key.startswith(("ProfilerStep", *_WRAPPERS))
        and not getattr(a, "is_user_annotation", False)
    ]
    averages.sort(key=lambda a: getattr(a, key, 0.0), reverse=True)
    top = [(a.key, float(getattr(a, key, 0.0)), int(a.count)) for a in averages[:TOP_OPS]]
    return {
        "device": device,
        "steps": steps,
        "compute": merge(compute),
        "comm": comm,
        "top": top,
        "trace": _trace(prof),
    }


def _trace(prof: Any) -> bytes:
    """The window's Chrome trace, gzip-compressed.

    Exported into a folder of this user's alone (``mkdtemp``: 0700), never into the shared
    temp folder itself: torch's exporter writes ``<path>.tmp`` with mode 0666, following
    links, and renames it over the path; in ``/tmp`` any user could read every rank's trace,
    and a planted ``.tmp`` link would have it truncate a file of this user's."""
    with tempfile.TemporaryDirectory(prefix="nbdist-trace-") as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f:
            return gzip.compress(f.read(), compresslevel=5)


@contextmanager
def profiled(steps: int, device: str) -> Iterator[None]:
    """Profile optimizer steps ``SKIP_STEPS + 1`` to ``SKIP_STEPS + steps`` of the cell (the
    summary then waits in :func:`take`). ``steps`` 0: no profiler at all."""
    global _taken
    _taken = None
    if steps <= 0:
        yield
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)

    ending = False

    def ready(prof: Any) -> None:
        global _taken
        try:
            _taken = summarize(prof, device, partial=ending)
        except Exception as e:  # noqa: BLE001 - the cell trains on; the notebook says why
            _taken = {"error": f"{type(e).__name__}: {e}"}

    prof = profile(
        activities=activities,
        schedule=schedule(wait=SKIP_STEPS - 1, warmup=1, active=steps, repeat=1),
        on_trace_ready=ready,
    )
    handle = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: prof.step())
    prof.start()
    try:
        yield
    finally:
        handle.remove()
        ending = True
        prof.stop()  # a window the cell ended inside is summarised as far as it got


def take() -> dict[str, Any] | None:
    """The last profiled cell's summary (once), or None."""
    global _taken
    taken, _taken = _taken, None
    return taken

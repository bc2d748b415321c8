"""``%%distrain`` against what users would pick instead, on the same workload in the same run.

Variants (each with 1 and N workers; repetitions interleaved so machine drift hits all alike):

- ``torchrun``: ``torchrun --standalone --nproc_per_node N`` running a plain DDP script;
- ``accelerate``: accelerate's ``notebook_launcher(fn, num_processes=N)`` called from a Python
  process that has already imported torch and accelerate, as a notebook would have;
- ``distrain-cold``: the first ``%%distrain`` cell after ``%load_ext nbdist`` (cluster start
  included), ``distrain-warm``: the second, ``distrain-nolive``: a warm one with
  ``--no-autolog --no-plot`` (the cost of live metrics is warm vs. nolive);
- ``distrain-prestart``: ``%load_ext nbdist`` with the background start on (as in a Jupyter
  kernel), ``THINK_S`` seconds of the user reading, then the first ``%%distrain`` cell;
- ``tf-plain``: N plain Python processes with ``TF_CONFIG`` running Keras ``fit`` under
  ``MultiWorkerMirroredStrategy``; ``tf-distrain-cold`` / ``-warm`` / ``-nolive``: the same code
  through ``%%distrain --framework tf``.

Every variant runs ``workload.torch_train`` / ``workload.tf_train``, which stamp the wall clock at
the end of each step. Time-to-first-step is rank 0's first stamp minus the moment the launch
began (the command, the launcher call or the cell); steady step time is the mean step over the
steps after warm-up; wall time is launch to return.

    python benchmarks/launchers.py [--reps 3] [--steps 150] [--batch 128] [--n 2]

Writes ``build/bench/launchers.{json,md,png}``.

``--tag gpu`` is the GPU comparison instead: ``torchrun`` vs. ``%%distrain`` (cold, warm and
nolive) with one worker per visible GPU (N = the GPU count only), nccl, on
``workload.gpu_train`` (a 4-layer MLP of width 4096 in bf16, 300 steps of batch 8192 per
worker, data already on the GPU); the targets are the throughput and time-to-first-step ratios
to torchrun's. It refuses to run without CUDA. ``--budget-s`` stops starting repetitions once
that much time has passed (at least one always runs), so that a run fits in a time slot:

    python benchmarks/launchers.py --tag gpu [--reps 3] [--budget-s 180] [--out-dir DIR]

Writes ``build/bench/launchers-gpu.{json,md,png}`` (or into ``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "build" / "bench"
WARMUP_STEPS = 10
CHILD_TIMEOUT_S = 600

GPU_TAG = "gpu"
CPU_DEFAULTS = {"steps": 150, "batch": 128}
GPU_DEFAULTS = {"steps": 300, "batch": 8192}

TORCH_VARIANTS = (
    "torchrun", "accelerate", "distrain-cold", "distrain-prestart", "distrain-warm",
    "distrain-nolive",
)  # fmt: skip
THINK_S = 5.0  # distrain-prestart: between %load_ext and the first cell
TF_VARIANTS = ("tf-plain", "tf-distrain-cold", "tf-distrain-warm", "tf-distrain-nolive")
BASELINE = {"torch": "torchrun", "tf": "tf-plain"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpus() -> int:
    """Visible GPUs (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``), as nbdist counts them."""
    sys.path.insert(0, str(HERE.parent))
    from nbdist.engine.hardware import visible_gpus

    return len(visible_gpus())


def _gpu_names() -> list[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def no_cuda_reason(gpus: int) -> str | None:
    """Why ``--tag gpu`` cannot run here (None: it can)."""
    if not gpus:
        return (
            "no CUDA GPU visible (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them); "
            "run it on a machine with GPUs, or leave out --tag gpu for the CPU comparison"
        )
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} cannot use CUDA here (a CPU build?)"
    return None


# --- measurements -------------------------------------------------------------------------------


def measure(stamps: list[float], t0: float, end: float, n: int, batch: int) -> dict[str, float]:
    """Time-to-first-step, steady step time, wall time and samples/s from rank 0's step stamps."""
    w = min(WARMUP_STEPS, len(stamps) // 5)
    steady = (stamps[-1] - stamps[w]) / (len(stamps) - 1 - w)
    return {
        "first_step_s": stamps[0] - t0,
        "step_ms": steady * 1e3,
        "wall_s": end - t0,
        "samples_s": n * batch / steady,
    }


def summarize(records: list[dict[str, Any]], n: int, *, gpu: bool = False) -> dict[str, Any]:
    """Medians per (variant, workers), ratios to the plain script, scaling efficiency, targets."""
    keys = ("first_step_s", "step_ms", "wall_s", "samples_s")
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["variant"], r["workers"]), []).append(r)
    med = {
        g: {k: statistics.median(r[k] for r in rs) for k in keys} | {"reps": len(rs)}
        for g, rs in groups.items()
    }
    rows = []
    for (variant, workers), m in sorted(med.items(), key=lambda kv: (_order(kv[0][0]), kv[0][1])):
        framework = "tf" if variant.startswith("tf-") else "torch"
        base = med.get((BASELINE[framework], workers))
        one = med.get((variant, 1))
        row = {"variant": variant, "framework": framework, "workers": workers, **m}
        if base is not None:
            for k in keys:
                row[f"{k}_ratio"] = m[k] / base[k]
        if one is not None and workers > 1:
            row["efficiency"] = m["samples_s"] / (workers * one["samples_s"])
        rows.append(row)
    return {"rows": rows, "targets": targets(med, n, gpu=gpu)}


def _order(variant: str) -> int:
    return (TORCH_VARIANTS + TF_VARIANTS).index(variant)


def targets(
    med: dict[tuple[str, int], dict[str, float]], n: int, *, gpu: bool = False
) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value and whether it is met (at N workers).
    On GPUs (``gpu``) warm throughput is held against torchrun's, not step time against the
    faster launcher's."""
    out: list[dict[str, Any]] = []

    def get(variant: str, workers: int = n) -> dict[str, float] | None:
        return med.get((variant, workers))

    def add(name: str, value: float, limit: float, met: bool, unit: str = "") -> None:
        out.append({"target": name, "value": value, "limit": limit, "met": met, "unit": unit})

    warm, cold = get("distrain-warm"), get("distrain-cold")
    run, acc, nolive = get("torchrun"), get("accelerate"), get("distrain-nolive")
    if gpu:
        if warm and run:
            r = warm["samples_s"] / run["samples_s"]
            add("warm throughput / torchrun's", r, 0.97, r >= 0.97, "at least")
            r = warm["first_step_s"] / run["first_step_s"]
            add("warm first step / torchrun's", r, 1 / 50, r <= 1 / 50)
        if cold and run:
            r = cold["first_step_s"] / run["first_step_s"]
            add("cold first step / torchrun's", r, 1.0, r <= 1.0)
        if warm and nolive:
            r = warm["step_ms"] / nolive["step_ms"] - 1
            add("live metrics (autolog + panel) step-time cost", r, 0.02, r <= 0.02, "%")
        return out
    if warm and acc:
        r = warm["first_step_s"] / acc["first_step_s"]
        add("warm first step / notebook_launcher's", r, 1 / 20, r <= 1 / 20)
    if warm and run:
        r = warm["first_step_s"] / run["first_step_s"]
        add("warm first step / torchrun's", r, 1 / 50, r <= 1 / 50)
    if cold and run:
        r = cold["first_step_s"] / run["first_step_s"]
        add("cold first step / torchrun's", r, 1.0, r <= 1.0)
    prestart = get("distrain-prestart")
    if prestart and run:
        r = prestart["first_step_s"] / run["first_step_s"]
        add(f"first step {THINK_S:g} s after %load_ext / torchrun's", r, 0.25, r <= 0.25)
    if warm and (run or acc):
        best = min(x["step_ms"] for x in (run, acc) if x)
        r = warm["step_ms"] / best
        add("warm step time / the faster launcher's", r, 1.03, r <= 1.03)
    if warm and nolive:
        r = warm["step_ms"] / nolive["step_ms"] - 1
        add("live metrics (autolog + panel) step-time cost", r, 0.02, r <= 0.02, "%")
    if n > 1 and all(
        get(v, w) for v in ("distrain-warm", "torchrun", "accelerate") for w in (1, n)
    ):

        def eff(v: str) -> float:
            return get(v)["samples_s"] / (n * get(v, 1)["samples_s"])

        theirs = max(eff("torchrun"), eff("accelerate"))
        add(
            f"scaling efficiency 1→{n}, minus the better launcher's",
            eff("distrain-warm") - theirs,
            -0.02,
            eff("distrain-warm") >= theirs - 0.02,
        )
    tf_warm, tf_plain = get("tf-distrain-warm"), get("tf-plain")
    if tf_warm and tf_plain:
        r = tf_warm["step_ms"] / tf_plain["step_ms"]
        add("TF warm step time / plain TF workers'", r, 1.05, r <= 1.05)
    tf_nolive = get("tf-distrain-nolive")
    if tf_warm and tf_nolive:
        r = tf_warm["step_ms"] / tf_nolive["step_ms"] - 1
        add("TF live metrics (autolog + panel) step-time cost", r, 0.02, r <= 0.02, "%")
    return out


# --- drivers (run in the benchmark's own process) -----------------------------------------------


def _child(args: list[str], timeout: float = CHILD_TIMEOUT_S) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        proc = subprocess.run(
            [sys.executable, str(HERE / "launchers.py"), "--child", *args, "--out", str(out)],
            timeout=timeout,
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"benchmark child {args} failed:\n{proc.stdout}\n{proc.stderr}")
        return json.loads(out.read_text())


def _torchrun() -> list[str]:
    """The torchrun beside this Python, or the module it runs (a pip install --target, or a
    system Python whose scripts live elsewhere)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    return [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]


def run_torchrun(n: int, steps: int, batch: int, workload: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        t0 = time.time()
        proc = subprocess.run(
            [*_torchrun(), "--standalone", f"--nproc_per_node={n}", str(HERE / "launchers.py"),
             "--child", "torchrun-worker", "--steps", str(steps), "--batch", str(batch),
             "--workload", workload, "--out", str(out)],
            timeout=CHILD_TIMEOUT_S, capture_output=True, text=True, check=False,
        )  # fmt: skip
        end = time.time()
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun failed:\n{proc.stdout}\n{proc.stderr}")
        rank0 = json.loads(out.read_text())
    return [{"variant": "torchrun", **measure(rank0["stamps"], t0, end, n, batch)}]


def run_tf_plain(n: int, steps: int, batch: int) -> list[dict[str, Any]]:
    workers = [f"127.0.0.1:{free_port()}" for _ in range(n)]
    threads = max(1, (os.cpu_count() or 1) // n)  # what nbdist gives each local worker
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        t0 = time.time()
        procs = []
        for i in range(n):
            env = os.environ | {
                "TF_CONFIG": json.dumps(
                    {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
                ),
                "TF_CPP_MIN_LOG_LEVEL": "2",
            }
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(HERE / "launchers.py"),
                        "--child",
                        "tf-worker",
                        "--steps",
                        str(steps),
                        "--batch",
                        str(batch),
                        "--threads",
                        str(threads),
                        "--out",
                        str(out),
                    ],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )  # fmt: skip
            )
        logs = [p.communicate(timeout=CHILD_TIMEOUT_S)[0] for p in procs]
        end = time.time()
        if any(p.returncode for p in procs):
            raise RuntimeError("plain TF workers failed:\n" + "\n".join(logs))
        rank0 = json.loads(out.read_text())
    return [{"variant": "tf-plain", **measure(rank0["stamps"], t0, end, n, batch)}]


def run_once(
    variant: str, n: int, steps: int, batch: int, workload: str = "cpu"
) -> list[dict[str, Any]]:
    """One repetition of a variant; the distrain children return several variants at once."""
    common = ["--n", str(n), "--steps", str(steps), "--batch", str(batch), "--workload", workload]
    if variant == "torchrun":
        return run_torchrun(n, steps, batch, workload)
    if variant == "tf-plain":
        return run_tf_plain(n, steps, batch)
    if variant == "accelerate":
        return _child(["accelerate", *common])
    if variant == "distrain":
        return _child(["distrain", *common])
    if variant == "distrain-prestart":
        return _child(["distrain-prestart", *common])
    if variant == "tf-distrain":
        return _child(["tf-distrain", *common])
    raise ValueError(variant)


# --- children (fresh processes) -----------------------------------------------------------------


def child_torchrun_worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from workload import gpu_train, torch_train

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    train = gpu_train if a.workload == GPU_TAG else torch_train
    result = train(a.steps, a.batch)
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _accelerate_fn(steps: int, batch: int, out: str) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator
    from workload import torch_train

    Accelerator()  # what a notebook_launcher function starts with: sets up the process group
    if not dist.is_initialized():  # num_processes=1: accelerate runs fn in-process, no group
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    result = torch_train(steps, batch)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))


def child_accelerate(a: argparse.Namespace) -> list[dict[str, Any]]:
    import accelerate  # noqa: F401 - imported before the launch, as in a notebook
    import torch  # noqa: F401

    sys.path.insert(0, str(HERE))
    from accelerate import notebook_launcher

    rank0 = Path(a.out).with_suffix(".rank0.json")
    t0 = time.time()
    notebook_launcher(
        _accelerate_fn, args=(a.steps, a.batch, str(rank0)), num_processes=a.n,
        use_port=str(free_port()),
    )  # fmt: skip
    end = time.time()
    stamps = json.loads(rank0.read_text())["stamps"]
    return [{"variant": "accelerate", **measure(stamps, t0, end, a.n, a.batch)}]


TORCH_CELL = """
import sys
sys.path.insert(0, {here!r})
from workload import torch_train
torch_train({steps}, {batch})
"""

GPU_CELL = """
import sys
sys.path.insert(0, {here!r})
from workload import gpu_train
gpu_train({steps}, {batch})
"""

TF_CELL = """
import sys
sys.path.insert(0, {here!r})
from workload import tf_train
tf_train(strategy, {steps}, {batch})
"""


def child_distrain(a: argparse.Namespace, framework: str) -> list[dict[str, Any]]:
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    template = TF_CELL if framework == "tf" else GPU_CELL if a.workload == GPU_TAG else TORCH_CELL
    cell = template.format(here=str(HERE), steps=a.steps, batch=a.batch)
    flags = f"-n {a.n} --framework {framework} -o bench_result"
    prefix = "tf-" if framework == "tf" else ""
    runs = [
        ("distrain-cold", ""),
        ("distrain-warm", ""),
        ("distrain-nolive", " --no-autolog --no-plot"),
    ]
    records = []
    try:
        for variant, extra in runs:
            t0 = time.time()
            ip.run_cell_magic("distrain", flags + extra, cell)
            end = time.time()
            stamps = ip.user_ns["bench_result"].values[0]["stamps"]
            records.append({"variant": prefix + variant, **measure(stamps, t0, end, a.n, a.batch)})
    finally:
        ip.run_line_magic("distrain", "stop")
    return records


def child_distrain_prestart(a: argparse.Namespace) -> list[dict[str, Any]]:
    """``%load_ext nbdist``, the user thinking for ``THINK_S``, then the first cell."""
    from IPython.testing.globalipapp import start_ipython

    os.environ["NBDIST_PRESTART"] = "1"  # on in a Jupyter kernel; this shell has none
    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    time.sleep(THINK_S)
    cell = TORCH_CELL.format(here=str(HERE), steps=a.steps, batch=a.batch)
    try:
        t0 = time.time()
        ip.run_cell_magic("distrain", f"-n {a.n} --framework torch -o bench_result", cell)
        end = time.time()
    finally:
        ip.run_line_magic("distrain", "stop")
    stamps = ip.user_ns["bench_result"].values[0]["stamps"]
    return [{"variant": "distrain-prestart", **measure(stamps, t0, end, a.n, a.batch)}]


def child_tf_worker(a: argparse.Namespace) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(a.threads)
    tf.config.threading.set_inter_op_parallelism_threads(a.threads)
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    from workload import tf_train

    # Keras 3's fit fails under multi-worker MWMS (keras-team/keras#20585); a plain script needs
    # a fix too, and this is the one nbdist applies (see the README).
    from nbdist.engine.backends.tf_mwms import patch_keras

    patch_keras()
    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
    result = tf_train(strategy, a.steps, a.batch)
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        Path(a.out).write_text(json.dumps(result))


def child_main(a: argparse.Namespace) -> int:
    if a.child == "torchrun-worker":
        child_torchrun_worker(a)
        return 0
    if a.child == "tf-worker":
        child_tf_worker(a)
        return 0
    if a.child == "accelerate":
        records = child_accelerate(a)
    elif a.child == "distrain":
        records = child_distrain(a, "torch")
    elif a.child == "distrain-prestart":
        records = child_distrain_prestart(a)
    elif a.child == "tf-distrain":
        records = child_distrain(a, "tf")
    else:
        raise SystemExit(f"unknown child {a.child}")
    Path(a.out).write_text(json.dumps(records))
    return 0


# --- report -------------------------------------------------------------------------------------


def _gpu_text(gpus: int) -> str:
    if not gpus:
        return ", no GPU"
    names = _gpu_names()
    kind = f" {names[0]}" if names and len(set(names)) == 1 else ""
    return f", {gpus}×{kind} GPU" + ("s" if gpus > 1 else "")


def markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    workload = f" Workload: {meta['workload']}." if meta.get("workload") else ""
    lines = [
        f"Machine: {meta['machine']}; {meta['date']}; {meta['steps']} steps, batch {meta['batch']} "
        f"per worker, medians of {meta['reps']} interleaved repetitions. Ratios are to the plain "
        f"script (torchrun for PyTorch, plain TF_CONFIG workers for TensorFlow).{workload}",
        "",
        "| variant | workers | first step | ratio | step | ratio | wall | ratio | samples/s "
        "| efficiency 1→N |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        eff = f"{r['efficiency']:.2f}" if "efficiency" in r else ""
        lines.append(
            f"| {r['variant']} | {r['workers']} | {r['first_step_s']:.3f} s "
            f"| {r.get('first_step_s_ratio', float('nan')):.3f} | {r['step_ms']:.1f} ms "
            f"| {r.get('step_ms_ratio', float('nan')):.3f} | {r['wall_s']:.1f} s "
            f"| {r.get('wall_s_ratio', float('nan')):.2f} | {r['samples_s']:,.0f} | {eff} |"
        )
    lines += ["", "| target | measured | limit | met |", "|---|---|---|---|"]
    for t in summary["targets"]:
        if t["unit"] == "%":
            value, limit = f"{t['value'] * 100:+.1f}%", f"≤ {t['limit'] * 100:.0f}%"
        elif t["target"].startswith("scaling"):
            value, limit = f"{t['value']:+.2f}", f"≥ {t['limit']:+.2f}"
        elif t["unit"] == "at least":
            value, limit = f"{t['value']:.3f}", f"≥ {t['limit']:.3f}"
        else:
            value, limit = f"{t['value']:.3f}", f"≤ {t['limit']:.3f}"
        lines.append(f"| {t['target']} | {value} | {limit} | {'yes' if t['met'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def chart(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = [f"{r['variant']} ×{r['workers']}" for r in rows]
    colors = ["tab:orange" if "distrain" in r["variant"] else "tab:gray" for r in rows]
    axes[0].barh(labels, [r["first_step_s"] for r in rows], color=colors)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("time to first step (s, log scale)")
    axes[0].invert_yaxis()
    axes[1].barh(labels, [r["step_ms"] for r in rows], color=colors)
    axes[1].set_xlabel("steady-state step time (ms)")
    axes[1].invert_yaxis()
    axes[1].set_yticklabels([])
    fig.suptitle("nbdist (orange) vs. the alternatives (gray): same workload, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(
    records: list[dict[str, Any]],
    a: argparse.Namespace,
    *,
    n: int,
    gpus: int,
    reps: int,
    gpu: bool,
) -> str:
    """Write the json, md and png for ``records`` into ``a.out_dir``; returns the markdown."""
    summary = summarize(records, n, gpu=gpu)
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs" + _gpu_text(gpus)
        + f", Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "steps": a.steps,
        "batch": a.batch,
        "reps": reps,
        "n": n,
    }  # fmt: skip
    if gpu:
        import torch

        sys.path.insert(0, str(HERE))
        from workload import GPU_LAYERS, GPU_WIDTH

        meta["workload"] = (
            f"{GPU_LAYERS}-layer MLP of width {GPU_WIDTH} in bf16, DDP over nccl, torch "
            f"{torch.__version__} (CUDA {torch.version.cuda})"
        )
    out_dir = a.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "launchers" + (f"-{a.tag}" if a.tag else "")
    (out_dir / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "records": records, **summary}, indent=2) + "\n"
    )
    md = markdown(summary, meta)
    (out_dir / f"{stem}.md").write_text(md)
    chart(summary, out_dir / f"{stem}.png")
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="default 150 (--tag gpu: 300)")
    p.add_argument(
        "--batch", type=int, default=None, help="samples per worker per step (128; gpu: 8192)"
    )
    p.add_argument("--n", type=int, default=None, help="N (default: GPUs, or 2 on CPU)")
    p.add_argument("--frameworks", default="torch,tf")
    p.add_argument(
        "--tag", default="", help="suffix for the output files; 'gpu': the GPU comparison"
    )
    p.add_argument("--out-dir", type=Path, default=OUT, help="where the results go")
    p.add_argument(
        "--budget-s", type=float, default=None, help="start no repetition after this many s"
    )
    p.add_argument("--workload", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child_main(a)

    gpus = _gpus()
    gpu = a.tag == GPU_TAG
    if gpu:
        reason = no_cuda_reason(gpus)
        if reason is not None:
            print(f"launchers.py --tag gpu: {reason}", file=sys.stderr)
            return 2
    defaults = GPU_DEFAULTS if gpu else CPU_DEFAULTS
    a.steps = a.steps or defaults["steps"]
    a.batch = a.batch or defaults["batch"]
    n = a.n or (gpus or 2)
    frameworks = a.frameworks.split(",")
    plan = []
    if gpu:  # one worker per GPU, on the same GPUs: no 1-worker runs beside them
        plan, counts, workload = ["torchrun", "distrain"], [n], GPU_TAG
    else:
        if "torch" in frameworks:
            plan += ["torchrun", "accelerate", "distrain", "distrain-prestart"]
        if "tf" in frameworks:
            plan += ["tf-plain", "tf-distrain"]
        counts, workload = sorted({1, n}), "cpu"
    records = []
    started = time.monotonic()
    reps = 0
    for rep in range(a.reps):
        if rep and a.budget_s is not None and time.monotonic() - started > a.budget_s:
            print(f"budget of {a.budget_s:g} s spent: stopping after {rep} repetitions", flush=True)
            break
        reps += 1
        for workers in counts:
            # Rotate the order each repetition so no variant always runs first or last.
            for variant in plan[rep % len(plan) :] + plan[: rep % len(plan)]:
                for r in run_once(variant, workers, a.steps, a.batch, workload):
                    records.append(r | {"workers": workers, "rep": rep})
                    print(
                        f"rep {rep} ×{workers} {r['variant']:>17}: first step "
                        f"{r['first_step_s']:7.3f} s, step {r['step_ms']:6.1f} ms, wall "
                        f"{r['wall_s']:5.1f} s",
                        flush=True,
                    )
        # After every repetition: a run stopped from outside keeps what it measured.
        report(records, a, n=n, gpus=gpus, reps=reps, gpu=gpu)
    md = report(records, a, n=n, gpus=gpus, reps=reps, gpu=gpu)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

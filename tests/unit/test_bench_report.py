"""The launcher benchmark's arithmetic: measurements from step stamps, medians, ratios, targets."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "launchers", Path(__file__).parents[2] / "benchmarks" / "launchers.py"
)
launchers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launchers)


def test_measure_from_stamps():
    stamps = [100.0 + 0.5 + 0.01 * i for i in range(60)]  # first step 0.5 s after launch
    m = launchers.measure(stamps, t0=100.0, end=102.0, n=2, batch=64)
    assert m["first_step_s"] == pytest.approx(0.5)
    assert m["step_ms"] == pytest.approx(10.0)
    assert m["wall_s"] == 2.0
    assert m["samples_s"] == pytest.approx(2 * 64 / 0.01)


def _rec(variant, workers, first, step, samples):
    return {"variant": variant, "workers": workers, "first_step_s": first, "step_ms": step,
            "wall_s": 10.0, "samples_s": samples}  # fmt: skip


def test_summary_medians_ratios_efficiency_and_targets():
    records = [
        _rec("torchrun", 1, 6.0, 20.0, 1000.0),
        _rec("torchrun", 2, 6.0, 30.0, 1400.0),
        _rec("accelerate", 1, 2.0, 20.0, 1000.0),
        _rec("accelerate", 2, 2.0, 30.0, 1300.0),
        *(_rec("distrain-warm", 2, f, 30.3, 1400.0) for f in (0.05, 0.08, 0.06)),
        _rec("distrain-warm", 1, 0.04, 20.0, 1000.0),
        _rec("distrain-nolive", 2, 0.05, 30.0, 1400.0),
        _rec("distrain-cold", 2, 7.0, 30.0, 1400.0),
    ]
    summary = launchers.summarize(records, n=2)
    warm2 = next(
        r for r in summary["rows"] if r["variant"] == "distrain-warm" and r["workers"] == 2
    )
    assert warm2["reps"] == 3 and warm2["first_step_s"] == 0.06
    assert warm2["first_step_s_ratio"] == pytest.approx(0.01)
    assert warm2["step_ms_ratio"] == pytest.approx(1.01)
    assert warm2["efficiency"] == pytest.approx(0.7)
    targets = {t["target"]: (round(t["value"], 4), t["met"]) for t in summary["targets"]}
    assert targets == {
        "warm first step / notebook_launcher's": (0.03, True),
        "warm first step / torchrun's": (0.01, True),
        "cold first step / torchrun's": (1.1667, False),
        "warm step time / the faster launcher's": (1.01, True),
        "live metrics (autolog + panel) step-time cost": (0.01, True),
        "scaling efficiency 1→2, minus the better launcher's": (0.0, True),
    }
    md = launchers.markdown(summary, {"machine": "m", "date": "d", "steps": 1, "batch": 2,
                                      "reps": 3})  # fmt: skip
    assert "| cold first step / torchrun's | 1.167 | ≤ 1.000 | **no** |" in md


def test_gpu_targets_hold_throughput_and_first_step_against_torchrun():
    records = [
        *(_rec("torchrun", 1, f, 5.0, s) for f, s in ((9.0, 1000.0), (8.0, 1010.0), (10.0, 990.0))),
        *(_rec("distrain-warm", 1, f, 5.1, s) for f, s in ((0.05, 980.0), (0.04, 975.0))),
        _rec("distrain-nolive", 1, 0.04, 5.05, 1000.0),
        _rec("distrain-cold", 1, 12.0, 5.0, 1000.0),
    ]
    summary = launchers.summarize(records, n=1, gpu=True)
    targets = {t["target"]: (round(t["value"], 4), t["met"]) for t in summary["targets"]}
    assert targets == {
        "warm throughput / torchrun's": (0.9775, True),  # median 977.5 / 1000
        "warm first step / torchrun's": (0.005, True),  # 0.045 / 9.0
        "cold first step / torchrun's": (1.3333, False),
        "live metrics (autolog + panel) step-time cost": (0.0099, True),  # 5.1 / 5.05 - 1
    }
    assert [r["variant"] for r in summary["rows"]] == [
        "torchrun",
        "distrain-cold",
        "distrain-warm",
        "distrain-nolive",
    ]
    md = launchers.markdown(
        summary,
        {"machine": "m", "date": "d", "steps": 300, "batch": 8192, "reps": 2, "workload": "w"},
    )
    assert "| warm throughput / torchrun's | 0.978 | ≥ 0.970 | yes |" in md
    assert md.startswith("Machine: m; d; 300 steps, batch 8192 per worker, medians of 2 ")
    assert "TensorFlow). Workload: w.\n" in md


def test_gpu_benchmark_refuses_without_cuda():
    reason = launchers.no_cuda_reason(0)
    assert reason.startswith("no CUDA GPU visible")
    assert reason.endswith("or leave out --tag gpu for the CPU comparison")

"""The session's pure parts: framework choice, shown values, notices, flags, the namespace."""

from __future__ import annotations

import ast
import types

import pytest
from IPython.core.error import UsageError

from nbdist.engine.namespace import clear, user_variables
from nbdist.kernel.failures import stall_message, state_line
from nbdist.kernel.options import RunOptions, parse_run_options
from nbdist.kernel.prepare import choose_framework
from nbdist.kernel.regroup import Replicas
from nbdist.kernel.relay import show_displays
from nbdist.kernel.result import DistrainResult, PerRank, RankResult
from nbdist.kernel.session import shown_value
from nbdist.protocol import Stall


def _tree(src: str) -> ast.Module:
    return ast.parse(src)


def test_framework_choice():
    none = RunOptions()
    assert choose_framework(_tree("x = 1"), RunOptions(framework="tf"), "torch") == "tf"
    assert choose_framework(_tree("x = 1"), RunOptions(strategy="mirrored"), None) == "tf"
    assert choose_framework(_tree("import keras"), none, "torch") == "tf"
    assert choose_framework(_tree("model = nn.Linear(2, 2)"), none, "tf") == "torch"
    assert choose_framework(_tree("print(rank)"), none, "tf") == "tf"  # what the workers have
    assert choose_framework(_tree("print(rank)"), none, None) == "torch"  # installed here
    with pytest.raises(UsageError, match=r"it uses both tf and torch\). Add --framework"):
        choose_framework(_tree("import torch, tensorflow"), none, "torch")


def _result(*values, reprs=None):
    reprs = reprs or [None if v is None else repr(v) for v in values]
    ranks = tuple(
        RankResult(rank=i, host="h", value=v, value_repr=r, wall=0.0, stdout="", stderr="")
        for i, (v, r) in enumerate(zip(values, reprs, strict=True))
    )
    return DistrainResult(framework="torch", world_size=len(ranks), wall=0.0, ranks=ranks)


def test_shown_value_is_one_value_when_every_rank_agrees():
    assert shown_value(_result(42, 42)) == 42
    assert shown_value(_result(None, None)) is None
    unpicklable = shown_value(_result(None, None, reprs=["<lock>", "<lock>"]))
    assert repr(unpicklable) == "<lock>"
    # Keras' History (not brought back: it would import TensorFlow into the notebook), whose
    # reprs differ in their memory address only: once, as rank 0's.
    history = [f"<keras.src.callbacks.history.History object at 0x7fcf{a}>" for a in ("e8b", "99")]
    assert repr(shown_value(_result(None, None, reprs=history))) == history[0]


def test_shown_value_is_one_entry_per_rank_when_they_differ():
    shown = shown_value(_result(0, 10))
    assert isinstance(shown, PerRank) and list(shown) == [0, 10] and shown.ranks == [0, 1]
    assert repr(shown) == "[rank 0] 0\n[rank 1] 10"
    last_bit = shown_value(_result(0.1, 0.1 + 2**-56))  # exact: a last-bit difference shows
    assert isinstance(last_bit, PerRank) and repr(last_bit).endswith("0.10000000000000002")


def test_state_lines_and_the_on_stall_message():
    assert state_line("kept", ["model", "opt"]) == (
        "The workers' variables are kept (model, opt), as after an error in a Python REPL; fix "
        "the cell and run it again."
    )
    # Never "kept" where there is nothing (a session whose variables were lost before the cell).
    assert state_line("kept", []) == "The workers hold no variables; fix the cell and run it again."
    replicas = Replicas(models=("trainer.model",), differ={"trainer.model": [1]}, optimizers=())
    assert state_line("rebuilt", ["trainer"], replicas=replicas, raised=[0]) == (
        "The process group was rebuilt and every rank kept its variables (trainer); the next "
        "cell wraps trainer.model in DistributedDataParallel again. The replicas differ from "
        "rank 0's (trainer.model on rank 1): a rank that raised or was stopped mid-step can be a "
        "step behind. %distrain sync trainer --from 1 gives every rank rank 1's; %distrain "
        "compare trainer shows the difference."
    )
    assert state_line("rebuilt", ["x"]) == (
        "The process group was rebuilt and every rank kept its variables (x)."
    )
    assert state_line("dropped", ["model", "opt"], sharded=["model"]) == (
        "The process group was rebuilt; model is sharded across the ranks (FSDP2, DTensor), and "
        "shards cannot move to a new group, so the workers' variables were dropped (model, "
        "opt): re-run the cells that build them (or save a checkpoint with "
        "torch.distributed.checkpoint to resume)."
    )
    assert state_line("dropped", ["model", "opt"]) == (
        "The process group was rebuilt and the workers' variables were dropped (model, opt): "
        "re-run the cells that build them."
    )
    # Dropped where the clean-up was cut short: the line says why.
    assert state_line("dropped", ["x"], why=", since an interrupt cut it short") == (
        "The process group was rebuilt and the workers' variables were dropped (x), since an "
        "interrupt cut it short: re-run the cells that build them."
    )
    assert state_line("replaced", ["x"]) == (
        "The engines were replaced, and the workers' variables (x) went with them: re-run the "
        "cells that build them."
    )
    assert state_line("replaced", [], connected_stale="restart them") == "restart them"
    stalled = Stall(
        ranks=[0], steps={0: None}, idle={0: 3.0}, framework="torch", release_s=1.0, all_idle=True
    )
    assert stall_message(stalled, 3.0, [], [0], on=(0,)) == (
        "no progress for 3 s: rank 0 waits in a collective that needs every rank, but --on ran "
        "only ranks 0. Run collectives (DDP training, all_reduce, barrier) without --on; use "
        "--on for inspecting or plotting on some ranks."
    )


def test_session_flags():
    assert parse_run_options("--fresh").fresh is True
    assert parse_run_options("").fresh is False
    assert parse_run_options("--on 2,0,2").on == (0, 2)
    assert parse_run_options("--scan 1,2").fresh is True  # a scan never touches the session
    with pytest.raises(UsageError, match="--on does not go with it"):
        parse_run_options("--scan 1,2 --on 0")
    with pytest.raises(UsageError, match="expected ranks like 0 or 0,1"):
        parse_run_options("--on x")


def test_namespace_listing_and_clear():
    ns = {
        "__name__": "__main__", "In": [], "Out": {1: "big"}, "_": "big", "get_ipython": None,
        "rank": 0, "log": None, "model": object(), "np": types.ModuleType("np"), "_hidden": 1,
        "x": 3,
    }  # fmt: skip
    assert sorted(user_variables(ns)) == ["model", "x"]
    assert clear(ns) == ["model", "x"]
    assert sorted(ns) == ["In", "Out", "_", "__name__", "_hidden", "get_ipython"]
    assert ns["Out"] == {} and ns["_"] == ""


class _Ar:
    def __init__(self, outputs):
        self.outputs = outputs


def test_displays_are_labelled_only_when_several_ranks_display():
    shown = []
    html = {"data": {"text/html": "<b>0</b>"}, "metadata": {}}
    assert show_displays([_Ar([html]), _Ar([])], [0, 1], lambda d, m: shown.append(d)) == 1
    assert shown == [{"text/html": "<b>0</b>"}]
    shown.clear()
    two = {"data": {"text/html": "<b>1</b>"}, "metadata": {}}
    show_displays([_Ar([html]), _Ar([two])], [0, 1], lambda d, m: shown.append(d))
    assert shown == [
        {"text/plain": "[rank 0]"}, {"text/html": "<b>0</b>"},
        {"text/plain": "[rank 1]"}, {"text/html": "<b>1</b>"},
    ]  # fmt: skip

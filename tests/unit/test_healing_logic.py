"""When nbdist heals a session after a lost worker, and what it says (nbdist.kernel.healing)."""

from __future__ import annotations

from nbdist.engine.backends import tf_mwms
from nbdist.kernel.healing import Healed, why_not


class _Local:
    size = 4
    STARTS_ENGINES = True


class _Connected:
    size = 4
    STARTS_ENGINES = False


def test_what_can_be_healed():
    assert why_not(_Local(), "torch", [1], variables=True) is None
    assert why_not(_Local(), "torch", [1], variables=False) == "the workers held no variables"
    assert why_not(_Local(), "tf", [1], variables=True) is None  # every engine replaced
    assert why_not(_Connected(), "tf", [1], variables=True) == (
        "a TensorFlow MultiWorkerMirroredStrategy cannot change its cluster in place, and "
        "nbdist does not restart the engines of a connected cluster"
    )
    assert why_not(_Connected(), "torch", [1], variables=True) is None  # shrinks, at worst
    assert why_not(_Local(), "torch", [0, 1, 2, 3], variables=True) == "no rank survived"


RANK_VALUES = (
    "Values the cells computed from the rank (a gpu_id = LOCAL_RANK, a shard of your own) are "
    "rank {}'s on every rank now: set them again"
)


def test_what_a_healing_says():
    healed = Healed(
        ranks=(1, 2), source=0, sent=("model", "opt"), unsent={"it": "generator: TypeError"},
        rewrapped=("model",), modules=("np", "time"), samplers=("train_data.sampler",),
    )  # fmt: skip
    assert healed.text() == (
        "the session was healed: new engines took ranks 1, 2, and every rank got rank 0's "
        "variables (model, opt) and imports (np, time); the next cell wraps model in "
        "DistributedDataParallel again, on a new process group; train_data.sampler "
        f"(DistributedSampler) reads each rank's own shard again. {RANK_VALUES.format(0)}. Not "
        "sent, re-run the cells that make them: it (generator: TypeError)."
    )
    one = Healed(ranks=(1,), source=0, sent=("x",), unsent={}, rewrapped=())
    assert one.text() == (
        "the session was healed: a new engine took rank 1, and every rank got rank 0's "
        f"variables (x). {RANK_VALUES.format(0)}."
    )


def test_what_a_healing_on_fewer_ranks_says():
    healed = Healed(
        ranks=(0,), source=1, sent=("model",), unsent={}, rewrapped=(), replaced=False, size=2
    )
    assert healed.text() == (
        "the session was healed on fewer ranks: no engine could be started for rank 0, so the 2 "
        "that answer go on as ranks 0-1, and every rank got rank 1's variables (model). "
        f"{RANK_VALUES.format(1)}."
    )


def test_what_a_tensorflow_healing_says():
    healed = Healed(
        ranks=(1,), source=0, sent=("epochs", "model"), unsent={"ds": "DatasetV2: TensorFlow "
        "object of the old strategy"}, rewrapped=(), size=2, rebuilt=("model",),
        everyone=(tf_mwms.TITLE, tf_mwms.FIXED_CLUSTER),
    )  # fmt: skip
    assert healed.text() == (
        "the session was healed as far as TensorFlow allows: a MultiWorkerMirroredStrategy "
        "cannot change its cluster in place, so new engines took all 2 ranks, and every rank got "
        "rank 0's variables (epochs, model); the next cell builds model in its new strategy's "
        "scope (architecture, weights and optimizer state, from a .keras save). "
        f"{RANK_VALUES.format(0)}. Not sent, re-run the cells that make them: ds (DatasetV2: "
        "TensorFlow object of the old strategy)."
    )

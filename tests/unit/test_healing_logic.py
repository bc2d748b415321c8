"""When nbdist heals a session after a lost worker, and what it says (nbdist.kernel.healing)."""

from __future__ import annotations

from nbdist.kernel.healing import Healed, why_not


class _Local:
    size = 4

    def replace_ranks(self, ranks):  # a local cluster can start engines at given ranks
        raise AssertionError("not called here")


class _Connected:
    size = 4


def test_what_can_be_healed():
    assert why_not(_Local(), "torch", [1], variables=True) is None
    assert why_not(_Local(), "torch", [1], variables=False) == "the workers held no variables"
    assert why_not(_Local(), "tf", [1], variables=True) == (
        "a TensorFlow MultiWorkerMirroredStrategy cannot change its cluster in place"
    )
    assert why_not(_Connected(), "torch", [1], variables=True) == (
        "nbdist starts no engines on a connected cluster"
    )
    assert why_not(_Local(), "torch", [0, 1, 2, 3], variables=True) == "no rank survived"


def test_what_a_healing_says():
    healed = Healed(
        ranks=(1, 2), source=0, sent=("model", "opt"), unsent={"it": "generator: TypeError"},
        rewrapped=("model",),
    )  # fmt: skip
    assert healed.text() == (
        "the session was healed: new engines took ranks 1, 2, and every rank got rank 0's "
        "variables (model, opt); the next cell wraps model in DistributedDataParallel again, on "
        "a new process group. Not sent, re-run the cells that make them: it (generator: "
        "TypeError)."
    )

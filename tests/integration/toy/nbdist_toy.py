"""A third framework for nbdist, from a package of its own (test_third_backend.py).

Its ranks share no group: each learns its rank and the world from the environment its
rendezvous gives it (``TOY_RANK``, ``TOY_WORLD``) and the cell sees them as ``toy``. It
implements every part of nbdist's backend interface (``nbdist.engine.backends``), heals
nothing, and exports a script run with one process per rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from nbdist.protocol import Prepared

NAME = "toy"
TITLE = "Toy"
MODULE = "json"  # what must be installed for it: the standard library's
CELL_NAMES = frozenset({"toy"})
FLAGS = ()
CHOSEN_BY = ()
NOT_HERE = {
    "profile": "the toy framework has no profiler; drop --profile",
}
PRELOAD_AT_START = True
SAME_STEPS = "give every rank the same number of steps"
GRACEFUL_STOP = False
KEEPS_RENDEZVOUS_AFTER_FAILURE = True
RELEASE_FREES_PEERS = False
SURVIVES_INTERRUPT = True
NOT_HEALED = "a Toy session holds nothing a new rank could be given"
FIXED_CLUSTER = None
GROUP = "toy world"
REWRAP = "uses {models} as they are"
EXPORTER = __name__
ENGINE_MB = 66  # a bare engine's resident memory


def workers_used(options: Mapping[str, Any], available: int) -> int:
    return available


def collective_timeout(options: Mapping[str, Any]) -> float:
    return 10.0


def peer_release_s(options: Mapping[str, Any]) -> float:
    return 1.0


def rendezvous_key(options: Mapping[str, Any], *, gpus: bool, world: int) -> tuple[Any, ...]:
    return (NAME, world)


def opens_servers(options: Mapping[str, Any]) -> bool:
    return False


def preload() -> None:
    pass


def warm_up(*, local_world_size: int, cpus: int) -> None:
    pass


def prepare(*, rank: int, world_size: int, options: Mapping[str, Any], state: Any) -> Prepared:
    return Prepared(info={"pid": os.getpid()})


def rendezvous(hosts: Sequence[str], prepared: Sequence[Prepared]) -> list[dict[str, str]]:
    pids = ",".join(str(p.info["pid"]) for p in prepared)
    return [
        {"TOY_RANK": str(rank), "TOY_WORLD": str(len(hosts)), "TOY_PIDS": pids}
        for rank in range(len(hosts))
    ]


@contextmanager
def session(spec: Any, state: Any) -> Iterator[dict[str, Any]]:
    yield {"toy": (int(os.environ["TOY_RANK"]), int(os.environ["TOY_WORLD"]))}


def healthy(state: Any, *, timeout: float) -> str | None:
    return None


def stop_board(spec: Any, state: Any) -> None:
    return None


def recover(state: Any) -> None:
    pass


_SETUP = """
import os
import sys

rank, world_size = int(os.environ["TOY_RANK"]), int(os.environ["TOY_WORLD"])
toy = (rank, world_size)
"""


def script(ran: Sequence[Any], used: set[str], path: Path) -> Any:
    from nbdist.kernel.export import Script

    n = ran[-1].world_size
    runs = "\n".join(f"    TOY_RANK={r} TOY_WORLD={n} python {path.name} &" for r in range(n))
    return Script(setup=[_SETUP], how=f"Run one process per rank:\n\n{runs}\n")

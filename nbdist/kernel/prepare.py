"""Before a cell runs: its framework, flags that must fit it, pushed data, the rendezvous.

Everything here that can fail on the user's input fails before the cluster is touched (no
engine is started or resized for a cell that a flag makes impossible).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from IPython.core.error import UsageError

from nbdist.engine import backends, worker
from nbdist.errors import ClusterError
from nbdist.kernel.cluster import Cluster
from nbdist.kernel.options import RunOptions
from nbdist.kernel.source import used_frameworks
from nbdist.protocol import Packed, Prepared, pack_values


def choose_framework(tree: Any, opts: RunOptions, current: str | None) -> str:
    """``--framework``; else the framework whose own flag the cell gives (``--strategy``);
    else what the cell uses; else what the workers already have set up; else the first one
    installed (torch, then TensorFlow)."""
    if opts.framework is not None:
        return opts.framework
    for backend in backends.all_backends():
        if any(getattr(opts, flag) is not None for flag in backend.CHOSEN_BY):
            return backend.NAME
    found = used_frameworks(tree)
    if len(found) == 1:
        return found.pop()
    if found:
        raise UsageError(
            "%%distrain: cannot tell which framework this cell is for (it uses both "
            f"{' and '.join(sorted(found))}). Add --framework "
            f"{'|'.join(backends.frameworks())} to the %%distrain line."
        )
    if current is not None:
        return current
    installed = backends.first_installed()
    if installed is not None:
        return installed
    raise UsageError(
        "%%distrain: neither torch nor tensorflow is installed in this kernel's environment; "
        "pip install torch (or tensorflow), then run the cell again."
    )


def check_flags(opts: RunOptions, framework: str) -> None:
    """Flags that are another framework's own: a UsageError before anything starts."""
    for flag, why in backends.load(framework).NOT_HERE.items():
        if getattr(opts, flag) is not None:
            raise UsageError(
                f"%%distrain: --{flag} is not available for {backends.load(framework).TITLE} "
                f"cells: {why}."
            )
    for backend in backends.all_backends():
        if backend.NAME == framework:
            continue
        for flag in backend.FLAGS:
            if getattr(opts, flag) is not None:
                raise UsageError(
                    f"%%distrain: --{flag} is for {backend.TITLE} cells; drop it for "
                    f"{framework}, or add --framework {backend.NAME}."
                )


def check_gpus(opts: RunOptions, *, gpus: bool) -> None:
    """``--backend nccl`` where the workers have no GPU (``gpus``): before a local cluster
    starts, whether this machine has any; on a running one, whether its engines do."""
    if opts.backend == "nccl" and not gpus:
        raise UsageError(
            "%%distrain: --backend nccl needs GPUs and this cluster has none. "
            "Use --backend gloo, or drop --backend to get gloo on CPU."
        )


def check_push(
    names: tuple[str, ...], user_ns: dict[str, Any], *, flag: str = "%%distrain: --push"
) -> tuple[dict[str, Any], Packed | None]:
    """The notebook variables to push, and what goes to the workers (packed once, not once
    per rank); or a ``UsageError`` naming the one that can't go."""
    values = {}
    for name in names:
        if name not in user_ns:
            raise UsageError(
                f"{flag} {name}: no variable {name!r} in the notebook; define it "
                "in a cell above, or check the spelling."
            )
        values[name] = user_ns[name]
    if not values:
        return values, None
    return values, pack_values(
        values,
        lambda name, value, e: UsageError(
            f"{flag} {name}: a {type(value).__name__} cannot be sent to the workers "
            f"({type(e).__name__}: {e}). Push what it is made from, and make it "
            "inside the cell."
        ),
    )


def backend_options(opts: RunOptions) -> dict[str, Any]:
    return {
        k: v
        for k, v in (
            ("backend", opts.backend),
            ("strategy", opts.strategy),
            ("timeout", opts.timeout),
        )
        if v is not None
    }


def warm_up(cluster: Cluster, framework: str, warm: set[str]) -> None:
    """Every engine imports ``framework`` (once: ``warm`` holds the frameworks they have)."""
    if framework in warm:
        return
    cluster.apply_all(
        worker.warm_up,
        lambda e: {"framework": framework, "local_world_size": e.local_world_size, "cpus": e.cpus},
    )
    warm.add(framework)


def rendezvous_key(
    cluster: Cluster, framework: str, opts: RunOptions, world: int
) -> tuple[Any, ...]:
    """What a rendezvous is made for (the backend says, defaults resolved)."""
    gpus = any(e.gpu for e in cluster.engines)
    return backends.load(framework).rendezvous_key(backend_options(opts), gpus=gpus, world=world)


def rendezvous(
    cluster: Cluster,
    framework: str,
    opts: RunOptions,
    world: int,
    options: dict[str, Any],
    session: Any,
) -> list[dict[str, str]]:
    """Each rank's environment; the session's live rendezvous when it was made for the same
    job shape."""
    key = rendezvous_key(cluster, framework, opts, world)
    live = session.rendezvous.get(framework)
    if live is not None and live.key == key:
        return live.envs
    hosts = [e.address for e in cluster.engines[:world]]
    with_master = {"master_addr": hosts[0], **options}

    def prepare() -> list[Prepared]:
        return cluster.apply_all(
            worker.prepare,
            lambda e: {
                "framework": framework,
                "rank": e.rank,
                "world_size": world,
                "options": with_master,
            },
            ranks=range(world),
        )

    prepared = prepare()
    reasons = sorted({p.restart for p in prepared if p.restart})
    if reasons:
        cluster.replace_engines(
            notice=f"nbdist: restarting the workers: {reasons[0]}", why=reasons[0],
            note="the workers were restarted",
        )  # fmt: skip
        if cluster.stale:
            raise ClusterError(cluster.stale)
        warm_up(cluster, framework, session.warm)
        prepared = prepare()
    envs = backends.load(framework).rendezvous(hosts, prepared)
    session.rendezvous[framework] = Rendezvous(key=key, envs=envs)
    return envs


@dataclass
class Rendezvous:
    """A framework's live rendezvous on the current engines: the key it was made for and envs."""

    key: tuple[Any, ...]
    envs: list[dict[str, str]] = field(default_factory=list)

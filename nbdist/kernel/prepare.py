"""Before a cell runs: its framework, flags that must fit it, pushed data, the rendezvous.

Everything here that can fail on the user's input fails before the cluster is touched (no
engine is started or resized for a cell that a flag makes impossible).
"""

from __future__ import annotations

import importlib.util
import pickle
from typing import Any

from IPython.core.error import UsageError

from nbdist.engine import backends, worker
from nbdist.errors import ClusterError
from nbdist.kernel.cluster import LocalCluster, Rendezvous
from nbdist.kernel.options import RunOptions
from nbdist.kernel.source import used_frameworks


def choose_framework(tree: Any, opts: RunOptions, current: str | None) -> str:
    """``--framework``; else what the cell uses; else what the workers already have set up;
    else torch when it is installed, else TensorFlow."""
    if opts.framework is not None:
        return opts.framework
    if opts.strategy is not None:
        return "tf"
    found = used_frameworks(tree) & set(backends.FRAMEWORKS)
    if len(found) == 1:
        return found.pop()
    if found:
        raise UsageError(
            "%%distrain: cannot tell which framework this cell is for (it uses both "
            f"{' and '.join(sorted(found))}). Add --framework torch|tf to the %%distrain line."
        )
    if current is not None:
        return current
    for framework, module in (("torch", "torch"), ("tf", "tensorflow")):
        if importlib.util.find_spec(module) is not None:
            return framework
    raise UsageError(
        "%%distrain: neither torch nor tensorflow is installed in this kernel's environment; "
        "pip install torch (or tensorflow), then run the cell again."
    )


def check_flags(opts: RunOptions, framework: str) -> None:
    """Flags that do not fit the cell's framework: a UsageError before anything starts."""
    if opts.backend is not None and framework != "torch":
        raise UsageError(f"%%distrain: --backend is for torch cells; drop it for {framework}.")
    if opts.strategy is not None and framework != "tf":
        raise UsageError(
            f"%%distrain: --strategy is for TensorFlow cells; drop it for {framework}, "
            "or add --framework tf."
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
) -> dict:
    """The notebook variables to push, or a ``UsageError`` naming the one that can't go."""
    values = {}
    for name in names:
        if name not in user_ns:
            raise UsageError(
                f"{flag} {name}: no variable {name!r} in the notebook; define it "
                "in a cell above, or check the spelling."
            )
        try:
            pickle.dumps(user_ns[name])
        except Exception as e:
            raise UsageError(
                f"{flag} {name}: a {type(user_ns[name]).__name__} cannot be sent to "
                f"the workers ({type(e).__name__}: {e}). Push plain data (arrays, tensors, "
                "dicts) and build objects like models and loaders inside the cell."
            ) from None
        values[name] = user_ns[name]
    return values


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


def warm_up(cluster: LocalCluster, framework: str) -> None:
    if framework in cluster.warm:
        return
    cluster.apply_all(
        worker.warm_up,
        lambda e: {"framework": framework, "local_world_size": e.local_world_size, "cpus": e.cpus},
    )
    cluster.warm.add(framework)


def rendezvous_key(
    cluster: LocalCluster, framework: str, opts: RunOptions, world: int
) -> tuple[Any, ...]:
    """What a rendezvous is made for, with the defaults resolved (``--backend gloo`` on CPU is
    the group a cell without the flag gets). ``--timeout`` is left out: a group keeps the
    collective timeout it was made with."""
    if framework == "torch":
        gpus = any(e.gpu for e in cluster.engines)
        return (framework, opts.backend or ("nccl" if gpus else "gloo"), world)
    return (framework, opts.strategy or "multiworker", world)


def rendezvous(
    cluster: LocalCluster, framework: str, opts: RunOptions, world: int, options: dict[str, Any]
) -> list[dict[str, str]]:
    """Each rank's environment; the live rendezvous when it was made for the same job shape."""
    key = rendezvous_key(cluster, framework, opts, world)
    live = cluster.rendezvous.get(framework)
    if live is not None and live.key == key:
        return live.envs
    hosts = [e.address for e in cluster.engines[:world]]
    with_master = {"master_addr": hosts[0], **options}

    def prepare() -> list[dict]:
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
    reasons = sorted({p["restart"] for p in prepared if p.get("restart")})
    if reasons:
        cluster.replace_engines(
            notice=f"nbdist: restarting the workers: {reasons[0]}", why=reasons[0]
        )
        if cluster.stale:
            raise ClusterError(cluster.stale)
        warm_up(cluster, framework)
        prepared = prepare()
    envs = backends.load(framework).rendezvous(hosts, prepared)
    cluster.rendezvous[framework] = Rendezvous(key=key, envs=envs)
    return envs

"""Whether a TensorFlow multi-worker job would expose its workers, and the opt-in it then needs.

MultiWorkerMirroredStrategy starts a gRPC server in every worker. TensorFlow binds it to every
interface and, as its SECURITY.md says, such a server has no authorisation: whoever reaches it
can run arbitrary code in the worker. nbdist's own local cluster keeps its engines in a private
loopback-only network (:mod:`nbdist.kernel.netns`), where that reaches nobody. Where it cannot
(namespaces refused, ``NBDIST_ENGINE_NETWORK=host``, or a connected cluster whose engines run
elsewhere), a multi-worker job needs ``--expose-tf`` and says once what is exposed to whom.
``--strategy mirrored`` runs in one process and opens no server.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from IPython.core.error import UsageError

from nbdist.kernel.netns import host_network_asked


def _opens_servers(framework: str, options: Mapping[str, Any]) -> bool:
    from nbdist.engine import backends

    return bool(backends.load(framework).opens_servers(options))


def tf_exposure(cluster: Any, framework: str, options: Mapping[str, Any]) -> str | None:
    """Who could reach this job's TensorFlow servers, or None when nobody outside the workers."""
    if not _opens_servers(framework, options):
        return None
    return cluster.tf_exposure()


def _refusal(who: str) -> UsageError:
    return UsageError(
        "%%distrain: TensorFlow's MultiWorkerMirroredStrategy starts a gRPC server in each "
        f"worker that accepts code from anybody, and here {who} could reach them. Use "
        "--strategy mirrored (one worker, no server), or add --expose-tf to run anyway."
    )


def check_tf_exposure_before_start(
    framework: str, options: Mapping[str, Any], *, allowed: bool
) -> None:
    """For a local cluster not started yet: refuse what its configuration already decides
    (engines asked onto the host's network), so that nothing starts for a cell that cannot run.
    A platform that refuses namespaces shows only once the cluster starts: then
    :func:`check_tf_exposure` refuses after the start."""
    reason = host_network_asked()
    if allowed or reason is None or not _opens_servers(framework, options):
        return
    raise _refusal(f"anyone who can reach this machine ({reason})")


def check_tf_exposure(
    cluster: Any,
    framework: str,
    options: Mapping[str, Any],
    *,
    allowed: bool,
    notify: Callable[[str], None],
    told: bool = False,
) -> bool:
    """Refuse an exposed multi-worker TensorFlow job unless ``allowed``; tell once (``told``:
    said already for these workers) when it is. Returns whether it has been told."""
    who = tf_exposure(cluster, framework, options)
    if who is None:
        return told
    if not allowed:
        raise _refusal(who)
    if not told:
        notify(
            "nbdist: --expose-tf: each TensorFlow worker's gRPC server listens on every "
            f"interface of its host, with no authentication; {who} can run code in your workers "
            "while the engines run."
        )
    return True

"""``%distrain connect``: what it trusts before it hands a connection file to ipyparallel,
and the client it opens (:func:`open_client`).

ipyparallel's client reads the controller's address, its message-signing key and the names of
the functions that (un)serialise every message from the connection file, and *imports* those
names: a file someone else could write is code someone else could run in this kernel. So the
file, and the profile folder it lives in, must belong to this user and be writable by nobody
else, and the serialisers must be one of ipyparallel's standard ones.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbdist.errors import ClusterError

STANDARD_SERIALIZERS = ("json", "pickle")  # jupyter_client.Session's built-in names


def check_private(path: Path, what: str) -> None:
    """Refuse ``path`` unless this user owns it and neither group nor others can write it."""
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise ClusterError(
            f"%distrain connect: the {what} {path} belongs to uid {st.st_uid}, not to you "
            f"(uid {os.getuid()}): whoever owns it could run code in this kernel. Use a "
            "connection file or profile of your own."
        )
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise ClusterError(
            f"%distrain connect: the {what} {path} is writable by other users "
            f"(mode {stat.S_IMODE(st.st_mode):o}), who could then run code in this kernel. "
            f"If it is yours, run: chmod go-w {path}"
        )


def check_connection_file(path: str | Path) -> None:
    """The file and its folder are private, and it names only standard serialisers."""
    path = Path(path)
    if not path.exists():
        return  # ipyparallel's own error says so
    check_private(path.resolve().parent, "folder of the connection file")
    check_private(path, "connection file")
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ClusterError(f"%distrain connect: cannot read {path} as JSON ({e})") from None
    for key in ("pack", "unpack"):
        value = info.get(key, "json")
        if value not in STANDARD_SERIALIZERS:
            raise ClusterError(
                f"%distrain connect: {path} asks for {key}={value!r}; nbdist accepts only "
                f"ipyparallel's standard serializers ({', '.join(STANDARD_SERIALIZERS)}), "
                "since ipyparallel would import and run any other name."
            )


def check_profile(*, profile: str | None, profile_dir: str | None, cluster_id: str | None) -> None:
    """The profile folder, its ``security`` folder and the client connection file in it (those
    that exist: a missing one is ipyparallel's error to report) pass the checks above."""
    if profile_dir is None:
        from IPython.core.profiledir import ProfileDir, ProfileDirError
        from IPython.paths import get_ipython_dir

        try:
            profile_dir = ProfileDir.find_profile_dir_by_name(
                get_ipython_dir(), profile or "default"
            ).location
        except ProfileDirError:
            return
    folder = Path(profile_dir)
    if not folder.exists():
        return
    check_private(folder, "profile folder")
    security = folder / "security"
    if security.exists():
        check_private(security, "profile's security folder")
    name = f"ipcontroller-{cluster_id}-client.json" if cluster_id else "ipcontroller-client.json"
    if (security / name).exists():
        check_connection_file(security / name)


def open_client(
    *,
    profile: str | None,
    cluster_id: str | None,
    profile_dir: str | None,
    url_file: str | None,
    timeout: float,
    before: Callable[[], None],
) -> tuple[Any, str]:
    """A Client of the cluster started elsewhere, once its engines have registered, and where it
    is (for messages). ``before`` runs once the files are trusted, before connecting (the
    notebook leaves its current cluster there)."""
    import ipyparallel as ipp

    if url_file is not None:
        check_connection_file(url_file)
        where = f"connection file {url_file}"
        kwargs: dict[str, Any] = {"connection_info": url_file}
    else:
        check_profile(profile=profile, profile_dir=profile_dir, cluster_id=cluster_id)
        where = f"profile {profile or 'default'}" + (
            f", cluster id {cluster_id}" if cluster_id else ""
        )
        kwargs = {"profile": profile, "profile_dir": profile_dir, "cluster_id": cluster_id}
    before()
    try:
        client = ipp.Client(timeout=timeout, **kwargs)
    except Exception as e:
        raise ClusterError(
            f"could not connect to the ipyparallel cluster ({where}): {e}. Is it running? "
            "Start it with: ipcluster start -n N --profile NAME (or check the profile, "
            "cluster id or connection file)."
        ) from None
    try:
        client.wait_for_engines(1, timeout=timeout, interactive=False)
        # Engines that register in a burst: give the rest a moment to arrive.
        seen, stable_since = len(client.ids), time.monotonic()
        while time.monotonic() - stable_since < 1.0:
            time.sleep(0.1)
            if len(client.ids) != seen:
                seen, stable_since = len(client.ids), time.monotonic()
    except Exception as e:
        client.close()
        raise ClusterError(
            f"connected to the controller ({where}) but no engine registered within "
            f"{timeout:.0f} s: {e}. Start engines with: ipcluster engines -n N --profile NAME."
        ) from None
    return client, where

"""What ``%distrain connect`` trusts before it hands a connection file to ipyparallel.

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
from pathlib import Path

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

"""``%distrain connect``: what it trusts before it hands a connection to ipyparallel, and the
client it opens (:func:`open_client`).

ipyparallel's client reads the controller's address, its message-signing key and the names of
the functions that (un)serialise every message from the connection file, and *imports* those
names; and what the controller sends back is unpickled in this kernel. So a file someone else
could write, or a controller someone else runs, is code someone else could run here. The file,
and the profile folders it lives in, must belong to this user and be writable by nobody else,
and the serialisers must be one of ipyparallel's standard ones.

Each file is **opened once and checked on the open handle**, and ipyparallel is given what was
read, never the path: a check of the path followed by a second open is a race another user can
win in a folder they can write into (rename the checked folder away, put their own in its
place). A folder is opened, checked (``fstat`` of the open folder), and what is in it is opened
relative to that handle; a symbolic link is never followed as the file itself.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from nbdist.errors import ClusterError

log = logging.getLogger(__name__)

STANDARD_SERIALIZERS = ("json", "pickle")  # jupyter_client.Session's built-in names
MAX_BYTES = 1 << 20
# How a refusal begins: connecting, or healing with the cluster's launcher (HEAL).
CONNECT = "%distrain connect: "


def check_private(st: os.stat_result, path: Path, what: str, prefix: str = CONNECT) -> None:
    """Refuse ``path`` (as ``st`` describes the open handle) unless this user owns it and
    neither group nor others can write it."""
    if st.st_uid != os.getuid():
        raise ClusterError(
            f"{prefix}the {what} {path} belongs to uid {st.st_uid}, not to you "
            f"(uid {os.getuid()}): whoever owns it could run code in this kernel. Use a "
            "connection file or profile of your own."
        )
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise ClusterError(
            f"{prefix}the {what} {path} is writable by other users "
            f"(mode {stat.S_IMODE(st.st_mode):o}), who could then run code in this kernel. "
            f"If it is yours, run: chmod go-w {path}"
        )


def _open_folder(path: Path, what: str, *, dir_fd: int | None = None, prefix: str = CONNECT) -> int:
    """An open handle on the folder ``path`` (relative to ``dir_fd`` when given, and then not
    through a symbolic link), checked private."""
    flags = os.O_RDONLY | os.O_DIRECTORY | (os.O_NOFOLLOW if dir_fd is not None else 0)
    try:
        fd = os.open(path if dir_fd is None else path.name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ClusterError(
            f"{prefix}there is no {what} {path}. Is the cluster running? Start it "
            "with: ipcluster start -n N --profile NAME"
        ) from None
    except OSError as e:
        raise ClusterError(f"{prefix}cannot open the {what} {path} ({e})") from None
    try:
        check_private(os.fstat(fd), path, what, prefix)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_connection(path: Path, *, dir_fd: int | None = None) -> dict[str, Any]:
    """The connection file ``path``, read once: not a symbolic link, private, within a private
    folder (the one ``dir_fd`` holds, else the one it names), naming standard serialisers."""
    info = _read_json(path, dir_fd=dir_fd, what="connection file")
    for key in ("pack", "unpack"):
        value = info.get(key, "json")
        if value not in STANDARD_SERIALIZERS:
            raise ClusterError(
                f"%distrain connect: {path} asks for {key}={value!r}; nbdist accepts only "
                f"ipyparallel's standard serializers ({', '.join(STANDARD_SERIALIZERS)}), "
                "since ipyparallel would import and run any other name."
            )
    return info


def _read_json(path: Path, *, dir_fd: int | None, what: str) -> dict[str, Any]:
    what_folder = "folder of the connection file"
    folder = dir_fd if dir_fd is not None else _open_folder(path.parent, what_folder)
    try:
        data = _read_private(path, folder, what)
    finally:
        if dir_fd is None:
            os.close(folder)
    if data is None:
        raise ClusterError(
            f"%distrain connect: there is no {what} {path}. Is the controller running? "
            "(ipcluster start writes it into the profile's security folder.)"
        )
    try:
        info = json.loads(data)
    except ValueError as e:
        raise ClusterError(f"%distrain connect: cannot read {path} as JSON ({e})") from None
    if not isinstance(info, dict):
        raise ClusterError(f"%distrain connect: {path} holds no JSON object")
    return info


def profile_folder(profile: str | None, profile_dir: str | None) -> Path:
    """The profile folder a connect names: ``--profile-dir``, else the IPython profile."""
    if profile_dir is not None:
        return Path(profile_dir)
    from IPython.paths import get_ipython_dir

    return Path(get_ipython_dir()) / f"profile_{profile or 'default'}"


@contextmanager
def _security_folder(profile: str | None, profile_dir: str | None) -> Iterator[tuple[Path, int]]:
    """A profile's ``security`` folder and an open handle on it: the profile folder, then the
    security folder relative to it, each checked private; the files in it are opened relative
    to the handle."""
    folder = profile_folder(profile, profile_dir)
    profile_fd = _open_folder(folder, "profile folder")
    try:
        security_fd = _open_folder(
            folder / "security", "profile's security folder", dir_fd=profile_fd
        )
        try:
            yield folder / "security", security_fd
        finally:
            os.close(security_fd)
    finally:
        os.close(profile_fd)


def _cluster_file(security: Path, security_fd: int, cluster_id: str | None) -> dict[str, Any]:
    return _read_json(
        security / f"cluster-{cluster_id or ''}.json", dir_fd=security_fd, what="cluster file"
    )


def read_profile(
    *, profile: str | None, profile_dir: str | None, cluster_id: str | None
) -> tuple[dict[str, Any], int | None]:
    """The client connection file of a profile, read once (the profile folder, its
    ``security`` folder and the file, each opened relative to the one before and checked), and
    how many engines ``ipcluster`` started for it, when its cluster file (read the same way)
    says."""
    name = f"ipcontroller-{cluster_id}-client.json" if cluster_id else "ipcontroller-client.json"
    with _security_folder(profile, profile_dir) as (security, security_fd):
        info = read_connection(security / name, dir_fd=security_fd)
        try:
            launched = _cluster_file(security, security_fd, cluster_id)
            sets = launched.get("engines", {}).get("sets", {}).values()
            # A set says its n (local launchers), or lists what it launched (SSH: one entry
            # per engine, each with its own n).
            expected = (
                sum(
                    max(
                        int(s.get("n") or 0),
                        sum(int(e.get("n") or 1) for e in s.get("engines", {}).values()),
                    )
                    for s in sets
                )
                or None
            )
        except (ClusterError, AttributeError, TypeError, ValueError):
            expected = None  # engines started by hand, or by another launcher
        return info, expected


# What starting engines for a profile loads from it: ipyparallel's cluster (ipython's config,
# then ipcluster's) in this kernel, each engine its own (ipython's, then ipengine's).
CONFIG_FILES = ("ipython_config", "ipcluster_config", "ipengine_config")
HEAL = "the cluster's launcher was not used: "


def launcher_config(profile_dir: Path) -> Any:
    """The configuration ``ipcluster`` would start engines with, from the profile folder's
    ``ipython_config`` and ``ipcluster_config`` (``.py`` and ``.json``), read once through a
    held, checked handle on the folder, and ``ipengine_config`` checked as well (each new
    engine loads it): every such file this user's, a regular file (never a link), writable by
    nobody else, else a ``ClusterError`` naming the file and the fix. A Python config file is
    code: one another user could write would run in this kernel (a group-writable file in a
    private folder, as umask 002 leaves them, did). The profile folder itself, and its parent,
    must be writable by nobody else (a sticky parent, as /tmp, lets others write but not
    rename): else the folder could be swapped between this check and an engine's start.
    What was read is loaded from a private copy, never from the profile by path."""
    import tempfile

    from traitlets.config import Config
    from traitlets.config.loader import JSONFileConfigLoader, PyFileConfigLoader

    parent = os.stat(profile_dir.parent)
    if stat.S_IMODE(parent.st_mode) & 0o022 and not parent.st_mode & stat.S_ISVTX:
        raise ClusterError(
            f"{HEAL}the folder {profile_dir.parent} holding the profile is writable by other "
            "users (and not sticky), who could swap the profile for their own: move the "
            f"profile into a folder of yours, or chmod go-w {profile_dir.parent}"
        )
    fd = _open_folder(profile_dir, "profile folder", prefix=HEAL)
    texts: dict[str, bytes] = {}
    try:
        for stem in CONFIG_FILES:
            for suffix in (".py", ".json"):
                name = stem + suffix
                data = _read_private(profile_dir / name, fd, "config file", prefix=HEAL)
                if data is not None:
                    texts[name] = data
    finally:
        os.close(fd)
    config = Config()
    with tempfile.TemporaryDirectory(prefix="nbdist-config-") as copy:
        for name in ("ipython_config", "ipcluster_config"):
            for suffix, loader in ((".py", PyFileConfigLoader), (".json", JSONFileConfigLoader)):
                if name + suffix in texts:
                    Path(copy, name + suffix).write_bytes(texts[name + suffix])
                    config.merge(loader(name + suffix, path=copy).load_config())
    return config


def _read_private(path: Path, dir_fd: int, what: str, prefix: str = CONNECT) -> bytes | None:
    """The file ``path`` in the folder ``dir_fd`` holds, read once (None: there is none): a
    regular file of this user's that nobody else can write, never through a link; else a
    ``ClusterError`` that begins with ``prefix``."""
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symbolic link
        raise ClusterError(
            f"{prefix}cannot open the {what} {path} ({e}); nbdist reads only a regular file of "
            "yours there, never through a symbolic link"
        ) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ClusterError(f"{prefix}the {what} {path} is not a regular file")
        check_private(st, path, what, prefix)
        return f.read(MAX_BYTES)


def read_cluster_file(
    *, profile: str | None, profile_dir: str | None, cluster_id: str | None
) -> dict[str, Any] | None:
    """The cluster file ``ipcluster start`` wrote for a profile (its launchers, what they
    started), read with the same checks as the connection file; None when there is none (a
    controller and engines started by hand)."""
    try:
        with _security_folder(profile, profile_dir) as (security, security_fd):
            return _cluster_file(security, security_fd, cluster_id)
    except ClusterError:
        return None


def where_text(
    *, profile: str | None, cluster_id: str | None, profile_dir: str | None, url_file: str | None
) -> str:
    """How the user named the cluster, for messages: the file, the profile folder or the
    profile (with its cluster id)."""
    if url_file is not None:
        return f"connection file {url_file}"
    where = f"profile folder {profile_dir}" if profile_dir else f"profile {profile or 'default'}"
    return where + (f", cluster id {cluster_id}" if cluster_id else "")


def open_client(
    *,
    profile: str | None,
    cluster_id: str | None,
    profile_dir: str | None,
    url_file: str | None,
    timeout: float,
    before: Callable[[], None],
) -> tuple[Any, str, int | None]:
    """A Client of the cluster started elsewhere, where it is (for messages), and how many
    engines its launcher started when it says. ``before`` runs once the connection is read and
    trusted, before connecting (the notebook leaves its current cluster there). The client is
    given what was read; nothing is read again."""
    import ipyparallel as ipp

    where = where_text(
        profile=profile, cluster_id=cluster_id, profile_dir=profile_dir, url_file=url_file
    )
    expected = None
    if url_file is not None:
        info = read_connection(Path(url_file).absolute())
    else:
        info, expected = _wait_for(
            lambda: read_profile(profile=profile, profile_dir=profile_dir, cluster_id=cluster_id),
            timeout,
        )
    before()
    try:
        client = ipp.Client(connection_info=info, timeout=timeout)
    except Exception as e:
        raise ClusterError(
            f"could not connect to the ipyparallel cluster ({where}): {e}. Is it running? "
            "Start it with: ipcluster start -n N --profile NAME (or check the profile, "
            "cluster id or connection file)."
        ) from None
    return quiet_late_replies(client), where, expected


def quiet_late_replies(client: Any) -> Any:
    """``client``, made to drop quietly the replies that come after ipyparallel gave up on
    them: a task it already answered for an engine it counted lost (a host whose link came
    back), or one another client sent. ipyparallel prints each, with the whole message, from
    its receiving thread: into whatever cell runs then."""

    def quiet(handle: Callable[[dict], None]) -> Callable[[dict], None]:
        def handler(msg: dict) -> None:
            md = msg.get("metadata", {})
            if md.get("is_broadcast") and md.get("is_coalescing"):
                msg_id = md.get("original_msg_id")
            else:
                msg_id = msg.get("parent_header", {}).get("msg_id")
            if msg_id not in client.outstanding:
                log.debug("late reply %s from engine %s dropped", msg_id, md.get("engine"))
                return
            handle(msg)

        return handler

    for kind in ("apply_reply", "execute_reply"):
        client._queue_handlers[kind] = quiet(client._queue_handlers[kind])
    return client


SETTLE_S = 5.0  # without an engine count: registration has settled after this long without one


def wait_for_engines(
    client: Any,
    *,
    n: int | None,
    timeout: float,
    where: str,
    restart: str,
    notify: Callable[[str], None],
) -> None:
    """Until ``n`` engines have registered, saying how many have as they come (SSH launchers
    register about one every 3 s, Slurm may take minutes); without ``n``, until none has come
    for ``SETTLE_S`` (at least one). At ``timeout``, a ClusterError that says how many came and
    what to type."""
    deadline = time.monotonic() + timeout
    seen, since = -1, time.monotonic()
    while True:
        count = len(client.ids)
        if count != seen:
            if seen >= 0 or (n is not None and count < n):
                notify(f"nbdist: {count} of {n if n else '?'} engines registered ({where})")
            seen, since = count, time.monotonic()
        if n is not None and count >= n:
            return
        if n is None and count and time.monotonic() - since >= SETTLE_S:
            return
        if time.monotonic() > deadline:
            what = f"{count} of {n} engines" if n else f"{count} engines"
            raise ClusterError(
                f"connected to the controller ({where}), but only {what} registered within "
                f"{timeout:g} s. Wait and %distrain connect again with a longer --timeout, "
                f"start the missing engines, or use the ones there with -n {count or 1}. "
                f"{restart}"
            )
        time.sleep(0.2)


def _wait_for(read: Callable[[], Any], timeout: float) -> Any:
    """``read()``, retried while the file is not there yet (a controller writes it as it
    starts) for up to ``timeout`` seconds; any other refusal at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return read()
        except ClusterError as e:
            if "there is no" not in str(e) or time.monotonic() > deadline:
                raise
        time.sleep(0.2)

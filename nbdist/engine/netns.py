"""Linux network namespaces, through the C library (Python 3.11 has no ``os.setns``/``unshare``).

The local cluster's engines run in one network namespace that has only a loopback interface
(see :mod:`nbdist.kernel.netns`): whatever they listen on (TensorFlow's gRPC servers bind every
interface, gloo, the TCPStore) is reachable from each other over its loopback and from no other
namespace, so from no other host. Standard library only: this runs first thing in an engine,
and as the namespace's holder, run by path so that nothing but this file is imported (0.03 s
instead of 0.15 s through the package, which imports IPython):

    python -I -S nbdist/engine/netns.py {net,user}
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import struct
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

HOLDER_ENV = "NBDIST_NETNS_PID"  # the holder's PID:START; its /proc entry names the namespaces
USER_NS_ENV = "NBDIST_NETNS_USER"  # "1": the namespace belongs to a user namespace to join first


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(*, user: bool) -> None:
    """Move this (single-threaded) process into a new network namespace; with ``user``, into a
    new user namespace too, where this user keeps its own uid and gid (no privilege needed)."""
    uid, gid = os.getuid(), os.getgid()
    _check(_libc().unshare(CLONE_NEWNET | (CLONE_NEWUSER if user else 0)), "unshare")
    if user:
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)


def loopback_up() -> None:
    """Bring ``lo`` up: a new network namespace starts with it down."""
    import fcntl  # not at the top: nbdist's kernel side imports this module on every platform

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def ipv4_only() -> None:
    """Turn IPv6 off in this namespace (best effort). With ``::1`` on ``lo``, gloo picks it, and
    c10d's reverse lookup of ``::1`` then fails with EAI_AGAIN (no DNS server is reachable
    here) and prints a warning into every cell; on 127.0.0.1 the hosts file answers."""
    for conf in ("all", "default", "lo"):
        try:
            with open(f"/proc/sys/net/ipv6/conf/{conf}/disable_ipv6", "w") as f:
                f.write("1")
        except OSError:
            pass


def proc_stat(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter and start, in clock ticks since boot, from
    ``/proc/PID/stat`` (fields 3 and 22, read past the command name's closing parenthesis: a
    name may hold spaces and parentheses); None when there is no such process (or the line is
    not the format proc(5) documents). With its PID, the start names one process for good."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
        fields = text[text.rindex(b")") + 2 :].split()
        return fields[0].decode(), int(fields[19])
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None


def join(holder_pid: int, started: int | None, *, user: bool) -> None:
    """Move this process into the holder's network namespace (its user namespace first, when it
    has one). Call it before any thread starts: ``setns`` moves only the calling thread.

    The holder is process ``holder_pid`` only if it ``started`` when it did: a holder that died
    and whose PID another process took is not joined. Its namespaces are opened first, then its
    start is checked: the files opened are that process's whatever happens after.
    """
    libc = _libc()
    kinds = [("user", CLONE_NEWUSER)] if user else []
    fds = []
    try:
        for kind, flag in [*kinds, ("net", CLONE_NEWNET)]:
            fds.append((kind, flag, os.open(f"/proc/{holder_pid}/ns/{kind}", os.O_RDONLY)))
        stat_ = proc_stat(holder_pid)
        if started is not None and (stat_ is None or stat_[1] != started):
            raise OSError(
                errno.ESRCH,
                f"the cluster's namespace holder (process {holder_pid}) is gone; its PID now "
                "names another process",
            )
        for kind, flag, fd in fds:
            _check(libc.setns(fd, flag), f"setns({kind} namespace of process {holder_pid})")
    finally:
        for _, _, fd in fds:
            os.close(fd)


def join_from_env() -> None:
    """:func:`join` the namespace named by ``$NBDIST_NETNS_PID`` (``PID:START``), if set (and
    unset it)."""
    holder = os.environ.pop(HOLDER_ENV, "")
    user = os.environ.pop(USER_NS_ENV, "") == "1"
    if holder:
        pid, _, started = holder.partition(":")
        join(int(pid), int(started) if started.isdigit() else None, user=user)


def hold(mode: str) -> None:
    """The holder: make the namespace, say ``ready``, keep it until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is for the kernel, not for us
    try:
        unshare(user=mode == "user")
        loopback_up()
        ipv4_only()
    except OSError as e:  # "<errno> <what>": the notebook words the cause from the errno
        print(e.errno or 0, e.strerror or e, flush=True)
        sys.exit(1)
    except AttributeError:  # no unshare() in this C library: not Linux
        print(0, "no unshare() in this C library", flush=True)
        sys.exit(1)
    print("ready", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    hold(sys.argv[1])

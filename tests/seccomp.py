"""A seccomp filter that refuses some system calls with an errno, as container runtimes do.

Docker's default profile refuses ``unshare`` and ``setns`` (to processes without
CAP_SYS_ADMIN) with EPERM. :func:`refusing` returns a ``preexec_fn`` for ``subprocess`` that
installs such a filter in the child before it runs its program: it applies to that process
and everything it starts, and to nothing else. x86_64 only (the syscall numbers).
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct
from collections.abc import Callable

SYSCALLS = {"unshare": 272, "setns": 308}  # x86_64
AUDIT_ARCH_X86_64 = 0xC000003E
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
# BPF instructions
LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
RET_K = 0x06  # BPF_RET | BPF_K


def available() -> bool:
    return platform.system() == "Linux" and platform.machine() == "x86_64"


def _program(numbers: list[int], err: int) -> bytes:
    def ins(code: int, jt: int, jf: int, k: int) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    out = [
        ins(LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        ins(JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        ins(RET_K, 0, 0, SECCOMP_RET_ALLOW),
        ins(LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    for i, nr in enumerate(numbers):
        left = len(numbers) - i - 1
        out.append(ins(JEQ_K, left + 1, 0, nr))  # to the ERRNO return after the others
    out.append(ins(RET_K, 0, 0, SECCOMP_RET_ALLOW))
    out.append(ins(RET_K, 0, 0, SECCOMP_RET_ERRNO | err))
    return b"".join(out)


def refusing(*names: str, err: int = errno.EPERM) -> Callable[[], None]:
    """A ``preexec_fn`` refusing the system calls ``names`` with ``err``."""
    numbers = [SYSCALLS[n] for n in names]
    prog = _program(numbers, err)

    def install() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
        buf = ctypes.create_string_buffer(prog)
        fprog = struct.pack("HxxxxxxQ", len(prog) // 8, ctypes.addressof(buf))
        fbuf = ctypes.create_string_buffer(fprog)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fbuf), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")

    return install

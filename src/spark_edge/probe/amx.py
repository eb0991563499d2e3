"""Whether this process may use AMX tiles.

The amx_tile flag is not enough on Linux: AMX tile data is a dynamically enabled XSAVE feature,
and a process that touches it without first asking (arch_prctl ARCH_REQ_XCOMP_PERM for
XFEATURE_XTILEDATA) dies with SIGILL. The kernel refuses the request when it was built without
AMX support, when the signal stack is too small, or in sandboxes that filter arch_prctl.
Permission is per process and asking twice is harmless (torch and oneDNN ask too).
"""

from __future__ import annotations

import ctypes
import os

SYS_ARCH_PRCTL_X86_64 = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def request_amx_permission() -> bool:
    """Ask the kernel for AMX tile data; True when granted. Only meaningful on x86_64."""
    if os.uname().machine != "x86_64":
        return False  # the syscall number above is x86_64's
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        result = libc.syscall(
            ctypes.c_long(SYS_ARCH_PRCTL_X86_64), ctypes.c_long(ARCH_REQ_XCOMP_PERM), ctypes.c_long(XFEATURE_XTILEDATA)
        )
    except (OSError, AttributeError):
        return False
    return result == 0

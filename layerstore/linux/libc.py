"""The one loader of libc (ctypes, errno kept per call) and the errno helper every module here uses.

Each module of the package declares the argument types of the functions it calls on this one
`libc` (a function's declaration is shared: two modules never declare the same one differently).
No other module of the project loads libc (tests/test_house.py checks it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
libc.syscall.restype = ctypes.c_long


def check(ret: int, what: str) -> int:
    """`ret` if it is not negative, else `OSError` from errno, naming `what`."""
    if ret < 0:
        raise errno_error(what)
    return ret


def errno_error(what: str) -> OSError:
    """An `OSError` of the last call's errno, naming `what`."""
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")

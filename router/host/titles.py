"""Each process of a split host says what it is where `ps` looks, and dies with its parent.

`ps -ef`, `ps aux` and `htop` show the command line, which setproctitle rewrites to
`model-router: front 2`; `ps -e` and `top` show the 15-character thread name, set to
`router front 2`. Without setproctitle only the thread name is set (through /proc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal

__all__ = ["die_with_parent", "set_title"]

log = logging.getLogger("router.host.titles")
PR_SET_PDEATHSIG = 1


def set_title(role: str) -> None:
    """`model-router: <role>` on the command line, `router <role>` as the thread name."""
    short = f"router {role}"[:15]
    try:
        import setproctitle
    except ImportError:
        try:
            with open("/proc/self/comm", "w", encoding="ascii") as comm:
                comm.write(short)
        except OSError:
            pass
        return
    setproctitle.setproctitle(f"model-router: {role}")
    setproctitle.setthreadtitle(short)


def die_with_parent(parent: int) -> None:
    """Ask the kernel for SIGTERM when the parent dies (Linux), and end now if it already has."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is not None:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent:
        raise SystemExit(f"the parent process {parent} is gone")

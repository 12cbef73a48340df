"""Processes around Triton: its process group, the defunct stubs a crashed server leaves to
its parent, and the Linux process settings the launcher uses (Linux /proc; no-ops elsewhere)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: SIGTERM the server if the process that started it dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def process_group_members(pgid: int, zombies: bool = False) -> list[int]:
    """Processes whose process group is ``pgid``, zombies only if asked (Linux /proc; [] elsewhere)."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and (zombies or fields[0] != "Z"):
            members.append(int(entry.name))
    return sorted(members)


TRITON_COMMANDS = ("tritonserver", "triton_python_b", "mpirun")  # /proc comm names (15 characters at most)


def collect_defunct_stubs() -> list[int]:
    """Collect this process's defunct children that are Triton processes (backend stubs a
    crashed server left to us, its subreaper): they would stay as zombies otherwise. Other
    children are left to whoever started them. Linux /proc; [] elsewhere."""
    collected = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == "Z" and int(fields[1]) == os.getpid() and comm in TRITON_COMMANDS:
            try:
                os.waitpid(int(entry.name), os.WNOHANG)
                collected.append(int(entry.name))
            except ChildProcessError:
                pass
    if collected:
        logger.info("collected %d defunct Triton process(es): %s", len(collected), ", ".join(map(str, collected)))
    return collected


def remove_shared_memory(prefix: str) -> list[str]:
    """Remove the POSIX shared-memory regions (``/dev/shm``) whose names start with ``prefix``:
    what the Python backend of a server that was killed leaves behind (a server that unloads
    its models removes its own). Returns the names removed."""
    removed = []
    if not prefix or "/" in prefix:
        return removed
    for path in Path("/dev/shm").glob(prefix + "*"):
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    if removed:
        logger.info("removed %d shared-memory region(s) of a stopped server (%s*)", len(removed), prefix)
    return removed


def remove_cancel_channels(server_pid: int) -> None:
    """Remove the cancellation sockets of a stopped server's models
    (:class:`triton_backend.serving.triton.io.CancelChannel`, one folder per model)."""
    import shutil

    from triton_backend.serving.triton.io import server_cancel_folders

    for folder in server_cancel_folders(server_pid):
        shutil.rmtree(folder, ignore_errors=True)


def become_subreaper() -> None:
    """Linux: orphaned descendants (backend stubs of a server that died) become our children,
    so :meth:`TritonServer.reap` can collect them instead of leaving zombies to PID 1."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
        except OSError:
            pass


__all__ = ["TRITON_COMMANDS", "become_subreaper", "collect_defunct_stubs", "die_with_parent", "process_group_members",
           "remove_cancel_channels", "remove_shared_memory"]

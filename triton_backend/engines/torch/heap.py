"""Handing freed heap memory back to the OS (glibc ``malloc_trim``).

Weights of a few MiB each live in the heap, not in their own mappings (glibc raises its mmap
threshold after large frees), so freeing them alone leaves the process's RSS as it was, and a load
that alternates long-lived tensors (compact weights) with short-lived ones (the float tensor each
is quantized from) leaves holes the next allocations may not fit: the heap keeps growing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

logger = logging.getLogger(__name__)

_LIBC: ctypes.CDLL | None | bool = False  # False: not looked up yet; None: not glibc


def _libc() -> ctypes.CDLL | None:
    global _LIBC
    if _LIBC is False:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
            libc.malloc_trim  # noqa: B018  (glibc only)
            _LIBC = libc
        except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): the pages stay reusable in-process
            logger.debug("malloc_trim is not available here")
            _LIBC = None
    return _LIBC  # type: ignore[return-value]


def trim_heap(*, collect: bool = True) -> None:
    """Return the heap's free pages to the OS; ``collect``: first collect reference cycles (a
    module's cycles may hold released weights until collected)."""
    if collect:
        gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


__all__ = ["trim_heap"]

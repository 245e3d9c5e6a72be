"""How much of a mapping is resident, for tests of memory given back (`mincore`)."""

from __future__ import annotations

import ctypes
import mmap


def resident_bytes(address: int, nbytes: int) -> int:
    """How many bytes of the pages at [address, address + nbytes) are resident."""
    pages = -(-nbytes // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    assert ctypes.CDLL(None).mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vector) == 0
    return sum(v & 1 for v in vector) * mmap.PAGESIZE

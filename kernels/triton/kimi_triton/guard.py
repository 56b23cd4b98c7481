"""Buffers that end at a `PROT_NONE` page: Triton's interpreter does no bounds checking, so an
unmasked load or store one element past a buffer reads the next allocation silently; against a
guard page it faults at once (the test harness sees the process die)."""

import ctypes
import mmap

import numpy as np

from .npshim import Tensor

_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PROT_NONE = 0


def _protect(base, offset):
    if _libc.mprotect(ctypes.c_void_p(base + offset), _PAGE, _PROT_NONE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect")


def guarded(array, name=None):
    """A copy of `array` whose last byte is the last byte before a guard page (and a guard page
    before its first page), as a `Tensor`."""
    array = np.ascontiguousarray(array)
    nbytes = array.nbytes
    data_pages = max(1, -(-nbytes // _PAGE))
    m = mmap.mmap(-1, (data_pages + 2) * _PAGE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    _protect(base, 0)
    _protect(base, (data_pages + 1) * _PAGE)
    start = _PAGE + data_pages * _PAGE - nbytes
    view = np.frombuffer(m, dtype=array.dtype, count=array.size, offset=start).reshape(array.shape)
    view[...] = array
    return Tensor(view, name, keep=m)

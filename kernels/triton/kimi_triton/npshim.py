"""Just enough of a tensor for Triton's interpreter, over a numpy array (no torch).

The interpreter reads a kernel argument through `data_ptr()`, `dtype` (whose `str()` must be
`torch.<name>`), `untyped_storage()` (`data_ptr()`, `cpu()`, `copy_()`), `storage_offset()`,
`size()`, `stride()`, `new_empty()` and `set_()`. `cpu()` hands back the same storage, so the
kernel reads and writes the array's own memory — which lets a guarded buffer (see `guard.py`)
fault on the first byte past its end.
"""

import numpy as np

# Triton's native specializer caches dtype → type string by the dtype object's *address*: a
# dtype object must live as long as the process, or a new one at a freed address gets a stale
# type. So there is exactly one object per name, kept here.
_DTYPES = {}


class Dtype:
    def __init__(self, name, itemsize):
        self.name = name
        self.itemsize = itemsize

    def __str__(self):
        return "torch." + self.name

    __repr__ = __str__


def dtype(name, itemsize):
    if name not in _DTYPES:
        _DTYPES[name] = Dtype(name, itemsize)
    return _DTYPES[name]


class Storage:
    def __init__(self, array):
        self.array = array

    def data_ptr(self):
        return self.array.ctypes.data

    def cpu(self):
        return self

    def copy_(self, other):
        if other is not self:
            np.copyto(self.array, other.array)


class Tensor:
    """A C-contiguous numpy array posing as a tensor of `name` (default: numpy's own name, so a
    `uint16` array can pose as `bfloat16`)."""

    def __init__(self, array, name=None, keep=None):
        if not array.flags["C_CONTIGUOUS"]:
            raise ValueError("Tensor needs a C-contiguous array")
        self.array = array
        self.dtype = dtype(name or array.dtype.name, array.dtype.itemsize)
        self._storage = Storage(array)
        self._keep = keep  # whatever owns the memory (a guarded mapping)

    def data_ptr(self):
        return self.array.ctypes.data

    def untyped_storage(self):
        return self._storage

    def storage_offset(self):
        return 0

    def size(self):
        return tuple(self.array.shape)

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def new_empty(self, *args, **kwargs):
        return Tensor(np.empty(0, dtype=self.array.dtype), self.dtype.name)

    def set_(self, storage, offset, size, stride):
        if offset != 0:
            raise ValueError("npshim: storage offsets are not used")
        self.array = storage.array
        self._storage = storage
        return self

    def copy_(self, other):
        self._storage.copy_(other.untyped_storage())
        return self

"""Small stand-ins for torch/CuPy arrays, so the device-pool paths are tested without them:
an object exposing ``__cuda_array_interface__``, and DLPack tensors whose capsules are built
with ctypes (legacy ``dltensor`` and versioned ``dltensor_versioned``). Nothing here
dereferences a device address: kvpipe only reads the capsule and the interface dict."""

import ctypes
import itertools

# dlpack.h's device types.
CPU, CUDA, CUDA_HOST, ROCM, CUDA_MANAGED = 1, 2, 3, 10, 13
READ_ONLY, IS_COPIED = 1 << 0, 1 << 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# Capsules released, per producer tag, counted by the capsules' destructors: a released capsule
# is the producer's cue to free the tensor. The destructors live as long as the module, since a
# capsule may outlive its producer.
released = {}
_destructors = []
_tags = itertools.count()


def _destructor_for(tag):
    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def destructor(_capsule):
        released[tag] = released.get(tag, 0) + 1

    _destructors.append(destructor)
    return ctypes.cast(destructor, ctypes.c_void_p).value


class DLPackTensor:
    """A DLPack producer over memory at ``ptr`` (an int; a host address or a pretend device
    address). ``bits``/``lanes``: the item type; ``strides`` in items or None; ``legacy``: its
    ``__dlpack__`` predates DLPack 1.0 (no ``max_version``); the other fields break the capsule
    on purpose. ``keep`` is held, as a producer holds the memory it exports; ``released[tag]``
    counts this producer's capsules released."""

    def __init__(self, ptr, shape, *, bits=8, lanes=1, device=(CPU, 0), strides=None,
                 byte_offset=0, legacy=False, flags=0, major=1, tensor_device=None, ndim=None,
                 null_shape=False, name=None, keep=None):
        self.ptr, self.shape, self.bits, self.lanes = ptr, tuple(shape), bits, lanes
        self.device, self.strides, self.byte_offset = device, strides, byte_offset
        self.legacy, self.flags, self.major = legacy, flags, major
        self.tensor_device = tensor_device or device
        self.ndim = len(self.shape) if ndim is None else ndim
        self.null_shape, self.name, self.keep = null_shape, name, keep
        self.alive = []
        self.tag = next(_tags)
        self._destructor = _destructor_for(self.tag)

    def __dlpack_device__(self):
        return self.device

    def _tensor(self):
        shape = (ctypes.c_int64 * max(1, len(self.shape)))(*self.shape)
        self.alive.append(shape)
        t = DLTensor()
        t.data = self.ptr
        t.device = DLDevice(*self.tensor_device)
        t.ndim = self.ndim
        t.dtype = DLDataType(2, self.bits, self.lanes)
        if not self.null_shape:
            t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        if self.strides is not None:
            strides = (ctypes.c_int64 * len(self.strides))(*self.strides)
            self.alive.append(strides)
            t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = self.byte_offset
        return t

    def _capsule(self, versioned):
        if versioned:
            managed = DLManagedTensorVersioned(major=self.major, minor=0, flags=self.flags)
        else:
            managed = DLManagedTensor()
        managed.dl_tensor = self._tensor()
        self.alive.append(managed)
        name = self.name or (b"dltensor_versioned" if versioned else b"dltensor")
        self.alive.append(name)
        return _capsule_new(ctypes.addressof(managed), name, self._destructor)

    def __dlpack__(self, *, stream=None, max_version=None):
        if self.legacy and max_version is not None:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        return self._capsule(versioned=max_version is not None and max_version[0] >= 1)


class CudaArray:
    """A ``__cuda_array_interface__`` exporter of ``dims`` items of type string ``items`` at
    ``ptr``; ``device`` is what ``__dlpack_device__`` returns (None: no such method);
    ``entries`` override the dict's entries (a value of ``...`` removes one), ``interface``
    replaces the whole dict."""

    def __init__(self, ptr, dims, items="|u1", *, version=3, readonly=False, device=(CUDA, 0),
                 interface=None, **entries):
        cai = {"shape": tuple(dims), "typestr": items, "data": (ptr, readonly),
               "version": version, "strides": None, "stream": None}
        cai.update(entries)
        self.__cuda_array_interface__ = (
            interface if interface is not None else {k: v for k, v in cai.items() if v is not ...}
        )
        if device is not None:
            self.__dlpack_device__ = lambda: device

"""The few CUDA driver API calls the collectives need, through ctypes on libcuda (no build step).

torch exposes neither stream memory operations nor host registration of foreign memory, and the
vLLM CUDA wheel ships no cuda-python; libcuda.so.1 is on every machine that has a driver. Calls
act on the calling thread's current context, which torch has made the device's primary context
(call `torch.cuda.set_device` and touch the device first).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

from glmctl.collectives.collective_errors import CollectiveError

CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WAIT_VALUE_EQ = 0x1
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0
CU_STREAM_MEM_OP_WAIT_VALUE_32 = 1
CU_STREAM_MEM_OP_WRITE_VALUE_32 = 2
CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91

_u64 = ctypes.c_uint64
_u32 = ctypes.c_uint32


class BatchMemOp(ctypes.Structure):
    """CUstreamBatchMemOpParams (a 48-byte union); the wait and write variants share this layout:
    operation, CUdeviceptr address, 64-bit value slot (a 32-bit op uses its low half), flags, alias."""

    _fields_ = [
        ("operation", _u32),
        ("address", _u64),
        ("value", _u64),
        ("flags", _u32),
        ("alias", _u64),
        ("_pad", _u64),
    ]


assert ctypes.sizeof(BatchMemOp) == 48


@dataclass(frozen=True)
class MemOp:
    """One stream memory operation: wait until *address == value, or write value to address."""

    kind: str  # "wait" | "write"
    address: int
    value: int


def memop_array(ops: list[MemOp]) -> ctypes.Array:
    arr = (BatchMemOp * len(ops))()
    for i, op in enumerate(ops):
        if op.kind == "wait":
            kind, flags = CU_STREAM_MEM_OP_WAIT_VALUE_32, CU_STREAM_WAIT_VALUE_EQ
        elif op.kind == "write":
            kind, flags = CU_STREAM_MEM_OP_WRITE_VALUE_32, CU_STREAM_WRITE_VALUE_DEFAULT
        else:
            raise ValueError(op.kind)
        arr[i] = BatchMemOp(operation=kind, address=op.address, value=op.value, flags=flags, alias=0)
    return arr


class CudaDriver:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._err_str = self._bind(["cuGetErrorString"], [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])
        self._register = self._bind(["cuMemHostRegister_v2", "cuMemHostRegister"],
                                    [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint])
        self._unregister = self._bind(["cuMemHostUnregister"], [ctypes.c_void_p])
        self._dev_ptr = self._bind(["cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"],
                                   [ctypes.POINTER(_u64), ctypes.c_void_p, ctypes.c_uint])
        self._memcpy = self._bind(["cuMemcpyAsync"], [_u64, _u64, ctypes.c_size_t, ctypes.c_void_p])
        self._wait = self._bind(["cuStreamWaitValue32_v2", "cuStreamWaitValue32"],
                                [ctypes.c_void_p, _u64, _u32, ctypes.c_uint])
        self._write = self._bind(["cuStreamWriteValue32_v2", "cuStreamWriteValue32"],
                                 [ctypes.c_void_p, _u64, _u32, ctypes.c_uint])
        self._batch = self._bind(["cuStreamBatchMemOp_v2", "cuStreamBatchMemOp"],
                                 [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint],
                                 required=False)
        self._ctx_device = self._bind(["cuCtxGetDevice"], [ctypes.POINTER(ctypes.c_int)])
        self._attr = self._bind(["cuDeviceGetAttribute"],
                                [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int])
        # "batch" (one driver call per barrier) or "single" (one call per operation); the
        # communicator's self-test falls back to "single" if batches misbehave on a driver.
        self.memop_mode = "batch" if self._batch is not None else "single"

    def _bind(self, names: list[str], argtypes: list, required: bool = True):
        for name in names:
            fn = getattr(self._lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                return fn
        if required:
            raise CollectiveError(f"libcuda has none of {names}", hint="update the NVIDIA driver")
        return None

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self._err_str(rc, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else "unknown error"
            raise CollectiveError(f"{what} failed: CUDA driver error {rc} ({text})")

    def host_register(self, address: int, nbytes: int) -> None:
        flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
        self.check(self._register(address, nbytes, flags), f"registering {nbytes} bytes of host memory")

    def host_unregister(self, address: int) -> None:
        self.check(self._unregister(address), "unregistering host memory")

    def device_pointer(self, address: int) -> int:
        out = _u64()
        self.check(self._dev_ptr(ctypes.byref(out), address, 0), "cuMemHostGetDevicePointer")
        return out.value

    def current_device(self) -> int:
        dev = ctypes.c_int()
        self.check(self._ctx_device(ctypes.byref(dev)), "cuCtxGetDevice")
        return dev.value

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if nbytes > 0:
            self.check(self._memcpy(dst, src, nbytes, stream), f"cuMemcpyAsync of {nbytes} bytes")

    def write_value(self, stream: int, address: int, value: int) -> None:
        self.check(self._write(stream, address, value, CU_STREAM_WRITE_VALUE_DEFAULT),
                   "cuStreamWriteValue32")

    def wait_value(self, stream: int, address: int, value: int) -> None:
        self.check(self._wait(stream, address, value, CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32")

    def run_memops(self, stream: int, ops: list[MemOp], batch: ctypes.Array | None = None) -> None:
        """Enqueue `ops` in order on `stream` (`batch` is `memop_array(ops)`, prepared once)."""
        if self.memop_mode == "batch":
            arr = batch if batch is not None else memop_array(ops)
            self.check(self._batch(stream, len(ops), ctypes.addressof(arr), 0), "cuStreamBatchMemOp")
            return
        for op in ops:
            if op.kind == "wait":
                self.wait_value(stream, op.address, op.value)
            else:
                self.write_value(stream, op.address, op.value)


@functools.cache
def driver() -> CudaDriver:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CollectiveError(
            f"the CUDA driver library libcuda.so.1 cannot be loaded ({exc})",
            hint="host-staged collectives need an NVIDIA GPU with its driver installed",
        ) from exc
    return CudaDriver(lib)

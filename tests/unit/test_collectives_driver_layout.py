"""The ctypes image of CUstreamBatchMemOpParams matches cuda.h byte for byte (no GPU needed)."""

from __future__ import annotations

import ctypes
import struct

from glmctl.collectives.cuda_driver import MemOp, memop_array


def test_batch_memop_params_layout():
    arr = memop_array([MemOp("write", 0x1122334455667788, 7), MemOp("wait", 0xAB00, 1)])
    raw = bytes((ctypes.c_char * ctypes.sizeof(arr)).from_buffer(arr))
    assert len(raw) == 2 * 48  # sizeof(CUstreamBatchMemOpParams): a union padded to 6 x u64
    # {u32 operation; [pad]; CUdeviceptr address; union{u32 value; u64 value64}; u32 flags; [pad];
    #  CUdeviceptr alias}, then the union's padding
    op, addr, value, flags, alias = struct.unpack_from("<I4xQQI4xQ", raw, 0)
    assert (op, addr, value, flags, alias) == (2, 0x1122334455667788, 7, 0, 0)  # WRITE_VALUE_32
    op, addr, value, flags, _ = struct.unpack_from("<I4xQQI4xQ", raw, 48)
    assert (op, addr, value, flags) == (1, 0xAB00, 1, 1)  # WAIT_VALUE_32, CU_STREAM_WAIT_VALUE_EQ

"""Bounds-checked Triton interpreter: every load, store and atomic of an interpreted kernel must
land inside one of the tensors the launch was given (the view, not just its storage).

The interpreter reads and writes host memory through raw addresses and checks nothing, so an
out-of-range offset that faults on a GPU ("an illegal memory access") passes silently on CPU,
reading a neighbour's bytes. Inside `bounds_checked()` every memory op of every active lane is
checked against the [first byte, last byte] of each tensor argument of the current launch;
the first violation raises `OutOfBounds` naming the kernel, the program id and the nearest
tensor. Use only where TRITON_INTERPRET=1 was set before triton was imported.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

_state = threading.local()


class OutOfBounds(AssertionError):
    pass


def _extent(t) -> tuple[int, int] | None:
    """[lo, hi) bytes of a strided view (non-negative strides), None when it holds nothing."""
    if t.numel() == 0:
        return None
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _check(kind: str, ptrs, mask, elem_bytes: int) -> None:
    ranges = getattr(_state, "ranges", None)
    if ranges is None:
        return
    p = np.asarray(ptrs, dtype=np.uint64).reshape(-1).astype(np.int64)
    m = np.ones_like(p, dtype=bool) if mask is None else np.broadcast_to(np.asarray(mask), np.shape(ptrs)).reshape(-1)
    p = p[m.astype(bool)]
    if p.size == 0:
        return
    ok = np.zeros(p.shape, dtype=bool)
    for _, lo, hi in ranges:
        ok |= (p >= lo) & (p + elem_bytes <= hi)
    if ok.all():
        return
    bad = int(p[~ok][0])
    name, lo, hi = min(ranges, key=lambda r: min(abs(bad - r[1]), abs(bad - r[2])))
    raise OutOfBounds(f"{_state.kernel} program {_state.pid}: {kind} at byte {bad - lo:+d} of argument {name!r} "
                      f"({hi - lo} bytes); {int((~ok).sum())} lanes out of range")


def _elem_bytes(handle) -> int:
    ty = handle.get_element_ty()
    return max(1, ty.primitive_bitwidth // 8)


@contextlib.contextmanager
def bounds_checked():
    from triton.runtime import interpreter as it

    builder, executor = it.InterpreterBuilder, it.GridExecutor
    saved = {n: getattr(builder, n) for n in ("create_masked_load", "create_masked_store", "create_atomic_rmw",
                                              "create_atomic_cas", "set_grid_idx")}
    saved_init = executor._init_args_hst

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = saved_init(self, args_dev, kwargs)
        import inspect

        names = inspect.getfullargspec(self.fn).args
        ranges = []
        for name, arg in [*zip(names, args_hst, strict=False), *kwargs_hst.items()]:
            if hasattr(arg, "data_ptr") and hasattr(arg, "stride"):
                ext = _extent(arg)
                if ext:
                    ranges.append((name, *ext))
        _state.ranges, _state.kernel, _state.pid = ranges, getattr(self.fn, "__name__", "?"), None
        return args_hst, kwargs_hst

    def load(self, ptrs, mask, other, cache_policy, is_volatile):
        _check("load", ptrs.data, mask.data, _elem_bytes(ptrs))
        return saved["create_masked_load"](self, ptrs, mask, other, cache_policy, is_volatile)

    def store(self, ptrs, value, mask, cache_policy):
        _check("store", ptrs.data, mask.data, _elem_bytes(ptrs))
        return saved["create_masked_store"](self, ptrs, value, mask, cache_policy)

    def rmw(self, op, ptr, val, mask, sem, scope):
        _check("atomic", ptr.data, mask.data, _elem_bytes(ptr))
        return saved["create_atomic_rmw"](self, op, ptr, val, mask, sem, scope)

    def cas(self, ptr, cmp, val, sem, scope):
        _check("atomic_cas", ptr.data, None, _elem_bytes(ptr))
        return saved["create_atomic_cas"](self, ptr, cmp, val, sem, scope)

    def grid_idx(self, x, y, z):
        _state.pid = (x, y, z)
        return saved["set_grid_idx"](self, x, y, z)

    for n, f in (("create_masked_load", load), ("create_masked_store", store), ("create_atomic_rmw", rmw),
                 ("create_atomic_cas", cas), ("set_grid_idx", grid_idx)):
        setattr(builder, n, f)
    executor._init_args_hst = init_args
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(builder, n, f)
        executor._init_args_hst = saved_init
        _state.ranges = None

"""The plugin's Triton mHC path as torch ops, on CPU: the ops are defined through vLLM's own
registration helper (schemas inferred from glmctl.plugin.mhc.mhc_ops' annotations), run the kernels
under the Triton interpreter in a fresh process, keep the caller's leading shape, and their fake
implementations give torch.compile the same shapes and dtypes as the real ones."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.vllm

SCRIPT = textwrap.dedent("""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from glmctl.kernels import mhc_pre_post
    from glmctl.plugin.mhc import mhc_ops

    mhc_ops.register(dispatch_key="CPU")
    mhc_ops.register(dispatch_key="CPU")  # once per process
    t, n, h = 3, 4, 64
    g = torch.Generator().manual_seed(0)
    res = torch.randn(t, n, h, generator=g).to(torch.bfloat16)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    fn = torch.randn(n * (n + 2), n * h, generator=g) / 16
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(n * (n + 2), generator=g)
    post = torch.rand(t, n, 1, generator=g)
    comb = torch.softmax(torch.randn(t, n, n, generator=g), -1)
    w = torch.ones(h, dtype=torch.bfloat16)
    gates = (1e-6, 1e-6, 1e-6, 2.0, 20)
    ops = torch.ops.glmctl
    real = ops.mhc_fused_post_pre(x, res, post, comb, fn, scale, base, *gates, w, 1e-5, [1, 3])
    # the ops run the decode path GLMCTL_MHC_DECODE chose when they were registered
    want = mhc_pre_post.mhc_fused_post_pre(x, res, post, comb, fn, scale, base, *gates, w, 1e-5,
                                           decode=mhc_ops._decode)
    assert [tuple(a.shape) for a in real] == [(1, 3, n, h), (1, 3, n, 1), (1, 3, n, n), (1, 3, h)]
    assert all(torch.equal(a.reshape(b.shape), b) for a, b in zip(real, want))
    pre = ops.mhc_pre(res, fn, scale, base, *gates, None, 0.0, [3])
    assert all(torch.equal(a, b) for a, b in zip(pre, mhc_pre_post.mhc_pre(res, fn, scale, base, *gates,
                                                                           decode=mhc_ops._decode)))
    assert torch.equal(ops.mhc_post(x, res, post, comb, [3]), mhc_pre_post.mhc_post(x, res, post, comb))
    with FakeTensorMode() as mode:
        fake = ops.mhc_fused_post_pre(*(mode.from_tensor(v) for v in (x, res, post, comb, fn,
                                      scale, base)), *gates, mode.from_tensor(w), 1e-5, [1, 3])
    assert [(tuple(a.shape), a.dtype) for a in fake] == [(tuple(a.shape), a.dtype) for a in real]
    print("ok")
""")


def test_mhc_ops_run_and_fake_like_the_kernels():
    pytest.importorskip("vllm")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        result.stdout[-2000:] + result.stderr[-4000:])

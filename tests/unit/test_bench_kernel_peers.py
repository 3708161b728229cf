"""bench/kernels_peers.py: the peers' entry points are reached through ``Peers`` (stand-in peer
files, no GPU; the real files are fetched by whoever runs the bench)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")
BENCH = Path(__file__).resolve().parents[2] / "bench"


def _peers_module():
    spec = importlib.util.spec_from_file_location("kernels_peers_under_test",
                                                  BENCH / "kernels_peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peer_entry_points_are_called_not_shadowed(tmp_path):
    (tmp_path / "triton_sparse_mla_kernel.py").write_text(
        "from vllm.triton_utils import LOG2E\n"  # answered by the stand-ins while loading
        "def triton_sparse_mla_attention(q, kv, idx, scale, sm_count):\n"
        "    return ('mla', q, kv, idx, scale, sm_count, LOG2E > 1)\n")
    (tmp_path / "sm89_paged_indexer.py").write_text(
        "def sm89_paged_fp8_index_logits(*args):\n"
        "    return ('indexer', len(args))\n")
    peers = _peers_module().Peers(tmp_path)
    assert peers.has_mla and peers.has_indexer
    assert peers.mla("q", "kv", "idx", 0.5, 132) == ("mla", "q", "kv", "idx", 0.5, 132, True)
    assert peers.indexer_entry(1, 2, 3, 4, 5, 6) == ("indexer", 6)


def test_missing_peers_are_reported_absent(tmp_path):
    peers = _peers_module().Peers(tmp_path)
    assert not peers.has_mla and not peers.has_indexer

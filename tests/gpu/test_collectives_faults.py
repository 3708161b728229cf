"""A rank that dies or stalls makes the others raise an error naming it within seconds, instead of
hanging; nothing is left in /dev/shm."""

from __future__ import annotations

import os

import pytest

from glmctl.collectives.harness import run_ranks
from tests.gpu.collectives_workers import lose_a_rank

pytestmark = pytest.mark.gpu


def _leftovers(session: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"glmctl-coll-{session}")]


# 4096 elements take the direct path (a kernel polling host memory), 262144 a barrier path
# (stream memory operations): the watchdog releases both kinds of wait
@pytest.mark.parametrize("numel", [4096, 262144])
def test_killed_rank_is_named_not_waited_for(numel):
    session = f"kill{os.getpid()}n{numel}"
    results = run_ranks(lose_a_rank, 4, 2, "kill", 5.0, numel, timeout_s=120, session=session)
    assert results[2].exitcode == -9
    for r in (results[0], results[1], results[3]):
        assert r.ok, r.error
        assert r.value["culprit"] == 2 and "rank 2" in r.value["error"], r.value
        assert r.value["elapsed"] < 5.0, r.value  # a dead pid is seen at once, not after the timeout
    assert not _leftovers(session)


@pytest.mark.parametrize("numel", [4096, 262144])
def test_stalled_rank_is_named_after_the_timeout(numel):
    session = f"stall{os.getpid()}n{numel}"
    results = run_ranks(lose_a_rank, 2, 1, "stall", 2.0, numel, timeout_s=120, session=session)
    for r in results:
        assert r.ok, r.error
    survivor, victim = results[0].value, results[1].value
    assert survivor["culprit"] == 1 and "rank 1" in survivor["error"]
    assert 2.0 <= survivor["elapsed"] < 6.0, survivor
    assert "rank 1" in victim["error"]  # the stalled rank learns what happened when it wakes up
    assert not _leftovers(session)

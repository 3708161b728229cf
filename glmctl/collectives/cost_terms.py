"""What one host-staged call costs apart from its links: each path's protocol terms, fitted on the
thread rig, and what the rig adds on top of them (pure Python: no torch).

A call of path p (`call_plan` algorithm, `_int8` for INT8 payloads) over n ranks costs

    fixed_us + per_memop_us * memops(p, n) + per_poll_us * polls(p, n) + its bytes' time

- memops: the stream memory operations one rank issues per call. A barrier is an arrive (n-1
  writes) and an await (status write, n-1 waits, n-1 resets, status write): 3(n-1)+2; one-shot
  and gathers have 2 barriers, two-shot 3. The direct path issues none but one fence (a memory
  write) per flag round: `direct_1s` 1, `direct_2s` 2, `direct_ll` 0.
- polls: round trips a direct-path program waits for peers: one per flag round (`direct_ll` 1,
  `direct_1s` 1, `direct_2s` 2); the barrier paths wait in their memops.
- fixed: kernel launches and bodies; `per_memop_us` is one value for every path.
- codec (INT8 payloads on a path whose terms are predicted, not fitted): the kernels' extra
  arithmetic to encode and decode, per MiB of message (`codec_us_per_mib`); fitted terms hold it
  in their fixed cost and rate.

**What the rig imposes** (`bench/gpu/collectives_threads.py`: n ranks as threads on one GPU):
every rank's memory operations queue in that GPU's front end (a barrier pair took 12.9 / 53 /
211 us at 2 / 4 / 8 ranks: 0.57 us x all ranks' 20 / 88 / 368 operations), and every rank's bytes
cross its one link, both directions one after the other. So on the rig a call takes

    fixed + per_memop * n * memops + per_poll * polls + n * (D2H + H2D) / rate_gbps

with D2H, H2D one rank's bytes (`CollectivePlan.bytes_moved`), and `rate_gbps` what the path
achieves there (`rig_time_us`). On a node each rank has its own GPU and link: its own memops, its
own link at `rate_gbps / rig ceiling` of the link's rate, and all ranks' bytes through host memory
(`cost_model.breakdown`). `fit_costs` fits fixed, per_poll and the rate per path by least squares
in relative error over the rig's rows, after `per_memop` from its barrier rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace


def barrier_memops(ranks: int) -> int:
    return 3 * (ranks - 1) + 2


BARRIERS = {"one_shot": 2, "gather": 2, "two_shot": 3}
FENCES = {"direct_ll": 0, "direct_1s": 1, "direct_2s": 2}
ROUNDS = {"direct_ll": 1, "direct_1s": 1, "direct_2s": 2}
# The 2026-12-01 record's direct kernels polled one peer after the other (and its "direct", with
# flag lines, issued its release atomics in-kernel): one poll per peer and call.
SEQUENTIAL_POLLS = {"direct_ll": lambda n: n - 1, "direct": lambda n: n - 1}
# The direct two-shot path's INT8 codec, predicted (no rig row isolates it): beyond what the native
# kernels do, about 25 fp32 operations per message element (encode every element once: convert,
# |x|, group max, scale, round, clamp; decode the peers' records and the chunk sums: convert,
# multiply; re-encode the own chunk) on the `DIRECT_PROGRAMS` (16) SMs the kernels run on, at an
# L40's 128 lanes x ~2.5 GHz each: 16 x 128 x 2.5e9 / 25 = 2.0e11 elements/s, 2.6 us per MiB of a
# bf16 message (0.65 us for 32 tokens x 4096); it is not hidden under the host-memory waits of the
# same program, so it adds to them.
DIRECT_INT8_CODEC_US_PER_MIB = 2.6


def memops(path: str, ranks: int) -> int:
    base = path.removesuffix("_int8")
    if base in BARRIERS:
        return BARRIERS[base] * barrier_memops(ranks)
    return FENCES.get(base, 0)


def polls(path: str, ranks: int) -> int:
    return ROUNDS.get(path.removesuffix("_int8"), 0)


@dataclass(frozen=True)
class PathTerms:
    """One path's protocol terms: us, us, and the rate (GB/s) its bytes move at on the rig's one
    link (all ranks' bytes, both directions); `basis`: which rows, and how well they fit."""

    fixed_us: float
    per_poll_us: float
    rate_gbps: float
    basis: str = ""
    codec_us_per_mib: float = 0.0  # INT8 encode/decode arithmetic (predicted paths only)


@dataclass(frozen=True)
class ProtocolCosts:
    """Every path's terms, the shared per-memop cost, and the rig's pinned copy ceiling (GB/s, one
    direction) the rates are measured against."""

    source: str
    per_memop_us: float
    rig_ceiling_gbps: float
    paths: dict[str, PathTerms] = field(default_factory=dict)

    def terms(self, path: str) -> PathTerms:
        """INT8 paths not measured take their native path's terms."""
        return self.paths.get(path) or self.paths[path.removesuffix("_int8")]

    def latency_us(self, path: str, ranks: int) -> float:
        """The fixed part of one call on a node: this rank's own memops and polls."""
        t = self.terms(path)
        return t.fixed_us + self.per_memop_us * memops(path, ranks) + t.per_poll_us * polls(path, ranks)

    def codec_us(self, path: str, nbytes: int) -> float:
        """The INT8 codec's time for a message of `nbytes` (0 where the terms were fitted)."""
        return self.terms(path).codec_us_per_mib * nbytes / (1 << 20)

    def efficiency(self, path: str) -> float:
        """The path's rate over the copy engines' on the same link (at most 1)."""
        return min(1.0, self.terms(path).rate_gbps / self.rig_ceiling_gbps)

    def rig_time_us(self, path: str, ranks: int, d2h: int, h2d: int,
                    poll_count: Callable[[int], int] | None = None) -> float:
        """One call on the thread rig: every rank's memops in one queue, its bytes on one link."""
        t = self.terms(path)
        n_polls = poll_count(ranks) if poll_count else polls(path, ranks)
        return (t.fixed_us + self.per_memop_us * ranks * memops(path, ranks)
                + t.per_poll_us * n_polls + ranks * (d2h + h2d) / (t.rate_gbps * 1e3))


def with_direct_predictions(costs: ProtocolCosts, launch_us: float) -> ProtocolCosts:
    """The direct paths the record did not measure, predicted from what it did: the LL path's
    fixed cost, poll cost and rate (the same loads and stores of mapped host memory), one poll per
    flag round, and `launch_us` for each further kernel (`direct_1s` 1, `direct_2s` 2); INT8 on
    the two shots (`direct_2s_int8`) as `direct_2s` plus the codec (`DIRECT_INT8_CODEC_US_PER_MIB`:
    the same kernels, flag rounds and fences, fewer bytes: `CollectivePlan.bytes_moved`)."""
    ll = costs.paths.get("direct_ll")
    if ll is None:
        return costs
    paths = dict(costs.paths)
    for path, extra in (("direct_1s", 1), ("direct_2s", 2)):
        if path not in paths:
            paths[path] = PathTerms(
                round(ll.fixed_us + extra * launch_us, 2), ll.per_poll_us, ll.rate_gbps,
                f"predicted: direct_ll's terms, {extra} more kernel(s) at {launch_us:g} us, "
                f"{FENCES[path]} fence(s), {ROUNDS[path]} poll round(s)")
    if "direct_2s_int8" not in paths:
        two = paths["direct_2s"]
        paths["direct_2s_int8"] = replace(
            two, codec_us_per_mib=DIRECT_INT8_CODEC_US_PER_MIB,
            basis=f"predicted: direct_2s's terms ({two.basis.split(':')[0]}) and the INT8 codec at "
                  f"{DIRECT_INT8_CODEC_US_PER_MIB:g} us per MiB of message")
    return replace(costs, paths=paths)


# ---- fitting ---------------------------------------------------------------------------------


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Least squares a x = b (normal equations, Gauss-Jordan); None when singular."""
    k = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) for j in range(k)] + [sum(r[i] * y for r, y in zip(a, b,
         strict=True))] for i in range(k)]
    for c in range(k):
        p = max(range(c, k), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(k):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    return [m[i][k] / m[i][i] for i in range(k)]


def _nonneg_fit(a: list[list[float]], b: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: the best over which columns are left free."""
    k = len(a[0])
    best, best_err = [0.0] * k, float("inf")
    for mask in range(1, 1 << k):
        cols = [i for i in range(k) if mask >> i & 1]
        x = _solve([[r[i] for i in cols] for r in a], b)
        if x is None or min(x) < 0:
            continue
        full = [0.0] * k
        for i, v in zip(cols, x, strict=True):
            full[i] = v
        err = sum((sum(c * v for c, v in zip(r, full, strict=True)) - y) ** 2 for r, y in zip(a, b,
                  strict=True))
        if err < best_err:
            best, best_err = full, err
    return best


def fit_memop_us(rows: list[dict]) -> float:
    """us per memory operation from the rig's barrier-pair rows (all ranks' operations queue)."""
    pts = [(r["ranks"] * 2 * barrier_memops(r["ranks"]), r["time_us"]) for r in rows
           if r["op"] == "barrier" and r.get("graph") == "captured"]
    return sum(x * y for x, y in pts) / sum(x * x for x, _ in pts) if pts else 0.0


def path_of(row: dict) -> str:
    return row["algorithm"] + ("_int8" if row["dtype"] == "int8" else "")


def fit_costs(rows: list[dict], ceiling_gbps: float, source: str, *,
              poll_counts: dict[str, Callable[[int], int]] | None = None,
              skip_variants: tuple[str, ...] = ("memops-ce",)) -> ProtocolCosts:
    """`ProtocolCosts` from the rig's derived rows (`collectives-h200-threads.json`): by path, its
    captured, right all-reduce rows (a path only gathers use: its gather rows), variants in
    `skip_variants` (engine choices no default makes) left out. `poll_counts` overrides `polls`
    for a record whose kernels polled otherwise (`SEQUENTIAL_POLLS`)."""
    per_memop = fit_memop_us(rows)
    counts = poll_counts or {}
    by_path: dict[str, list[dict]] = {}
    for r in rows:
        if (r.get("graph") == "captured" and not r.get("wrong") and "algorithm" in r
                and r.get("variant") not in skip_variants):
            by_path.setdefault(path_of(r), []).append(r)
    paths = {}
    for path, mine in sorted(by_path.items()):
        # all-reduce rows where a path has them: a gather through the same path runs the same
        # protocol, but its kernels write every rank's part (the fit would mix two kernels)
        mine = [r for r in mine if r["op"] == "all_reduce"] or mine
        count = counts.get(path, lambda n, p=path: polls(p, n))
        a, b = [], []
        for r in mine:
            n, t = r["ranks"], r["time_us"]
            rest = t - per_memop * n * memops(path, n)
            data = n * (r["payload_bytes_d2h"] + r["payload_bytes_h2d"]) / 1e3
            a.append([1 / t, count(n) / t, data / t])
            b.append(rest / t)
        if len({count(r["ranks"]) for r in mine}) == 1:  # one poll count: fixed holds the polls
            a = [[x[0], 0.0, x[2]] for x in a]
        fixed, poll, inv_rate = _nonneg_fit(a, b)
        rate = 1 / inv_rate if inv_rate > 0 else float("inf")
        res = [r["time_us"] - _rig(per_memop, path, r, fixed, poll, inv_rate, count) for r in mine]
        rel = [abs(x) / r["time_us"] for x, r in zip(res, mine, strict=True)]
        worst = max(range(len(mine)), key=lambda i: rel[i])
        paths[path] = PathTerms(
            round(fixed, 2), round(poll, 3), round(rate, 1),
            f"fitted: {len(mine)} rows at {sorted({r['ranks'] for r in mine})} ranks, "
            f"{_size(min(r['rank_bytes'] for r in mine))}..{_size(max(r['rank_bytes'] for r in mine))}"
            f"; residual rms {100 * (sum(x * x for x in rel) / len(rel)) ** 0.5:.1f}%, worst "
            f"{res[worst]:+.1f} us ({100 * rel[worst]:.0f}%) at {mine[worst]['ranks']} ranks "
            f"{_size(mine[worst]['rank_bytes'])}")
    return ProtocolCosts(source=source, per_memop_us=round(per_memop, 4),
                         rig_ceiling_gbps=round(ceiling_gbps, 2), paths=paths)


def _rig(per_memop, path, r, fixed, poll, inv_rate, count) -> float:
    n = r["ranks"]
    return (fixed + per_memop * n * memops(path, n) + poll * count(n)
            + inv_rate * n * (r["payload_bytes_d2h"] + r["payload_bytes_h2d"]) / 1e3)


def _size(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    return f"{n >> 10} KiB" if n % 1024 == 0 else f"{n} B"


def record_costs(doc: dict) -> ProtocolCosts:
    """The fit of a thread-rig record (`collectives-h200-threads.json`, already loaded), with the
    poll counts its kernels had, and the direct paths it lacks predicted from it."""
    polls_of = None if doc["meta"].get("direct_polls") == "per round" else SEQUENTIAL_POLLS
    fit = fit_costs(doc["rows"], doc["ceiling"]["d2h"], f"fitted on the thread rig's run of "
                    f"{doc['meta']['measured_at']}", poll_counts=polls_of)
    launch = [r["time_us"] for r in doc["rows"] if r["op"] == "launch"]
    return with_direct_predictions(fit, min(launch)) if launch else fit


def main(argv: list[str] | None = None) -> int:
    """Print a record's fitted terms as the `PROTOCOL_COSTS` paths literal of `cost_model`."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m glmctl.collectives.cost_terms RECORD.json", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as fh:
        costs = record_costs(json.load(fh))
    print(f"per_memop_us={costs.per_memop_us!r}, rig_ceiling_gbps={costs.rig_ceiling_gbps!r}, paths={{")
    for path, t in costs.paths.items():
        print(f"    {path!r}: PathTerms({t.fixed_us!r}, {t.per_poll_us!r}, {t.rate_gbps!r}, "
              f"{t.basis!r}),")
    print("}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

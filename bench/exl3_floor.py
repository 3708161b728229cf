"""The floor model of bench/exl3_decode_rate.py: what a measured decode rate and bandwidth mean
for the routed experts of a decode step, on the measuring GPU and (predicted) on an L40.

Routed experts of a step >= layers x max(touched bytes / copy bandwidth, decoded weights / decode
rate): the weight bytes must cross DRAM once and every touched expert's weights must be decoded
once (once per run of <= 16 slots; one run per expert at these batch sizes); the two overlap, so
the larger bounds. Touched experts = 288 (1 - (1 - 8/288)^T) for T tokens (uniform routing).
The decode rate a GPU can reach at full issue follows from the loop's SASS per weight and the
pipes it uses (`issue_bound_rate`).
"""

from __future__ import annotations

EXPERTS, TOP_K, HIDDEN, INTER = 288, 8, 4096, 256
LAYERS_PER_STEP = 45  # MoE layer calls per target step at MTP-3 (42 sparse layers + 3 MTP passes)
STEP_TOKENS = {"8x22k": 32, "1x64k": 4}  # tokens per target step (sequences x (1 + 3 drafts))
BYTES_PER_EXPERT = 1_598_976  # trellis + suh/svh of gate, up, down on one TP8 rank
WEIGHTS_PER_EXPERT = 3 * HIDDEN * INTER
L40 = {"name": "L40 (predicted)", "sms": 142, "clock_hz": 2.49e9, "dram_bytes_per_s": 864e9}
STREAM_DEFAULT = "raw_k64_w4_s1_x4"  # the stream config whose SASS the predictions use (the MoE kernels' loop)


def issue_bound_rate(row: dict, sms: int, clock_hz: float) -> float | None:
    """Decoded weights per second at full issue (predicted): the tightest of the three pipes."""
    if not row.get("instr_per_weight"):
        return None
    lanes_per_clock = sms * 4 * clock_hz
    return min(32 * lanes_per_clock / row["instr_per_weight"],
               16 * lanes_per_clock / max(row["fma_heavy_per_weight"], 1e-9),
               16 * lanes_per_clock / max(row["alu_per_weight"], 1e-9))


def touched(tokens: int) -> float:
    return EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** tokens)


def step_model(bw_bytes_per_s: float, decode_rate: float | None) -> dict:
    """Routed experts per step (ms) at each cell: the bytes floor, the decode floor, their max."""
    out = {}
    for cell, tokens in STEP_TOKENS.items():
        e = touched(tokens)
        bytes_ms = LAYERS_PER_STEP * e * BYTES_PER_EXPERT / bw_bytes_per_s * 1e3
        decode_ms = LAYERS_PER_STEP * e * WEIGHTS_PER_EXPERT / decode_rate * 1e3 if decode_rate else None
        out[cell] = {"tokens": tokens, "touched_experts": round(e, 1), "bytes_floor_ms": round(bytes_ms, 2),
                     "decode_floor_ms": round(decode_ms, 2) if decode_ms else None,
                     "floor_ms": round(max(bytes_ms, decode_ms or 0), 2),
                     "bound": "decode" if decode_ms and decode_ms > bytes_ms else "bytes"}
    return out


def best(rows: list[dict], kernel: str, residency: str, mode: str | None = None) -> dict | None:
    hits = [r for r in rows if r["kernel"] == kernel and r["residency"] == residency and (mode is None or r["mode"] == mode)]
    return max(hits, key=lambda r: r["weights_per_s"]) if hits else None


def model(result: dict) -> dict:
    sms, clock = result["sm_count"], result["clock_hz"]
    bw = result["copy_bw_bytes_per_s"]
    rows = result["rows"]
    isa_rows = {(r["arch"], r["config"]): r for r in result["isa"]}
    raw_l2, raw_dram = best(rows, "glmctl_stream", "l2", "raw"), best(rows, "glmctl_stream", "dram", "raw")
    exl_l2 = best(rows, "exllamav3_exl3_gemm", "l2")
    sm90, sm89 = isa_rows.get(("sm_90", STREAM_DEFAULT)), isa_rows.get(("sm_89", STREAM_DEFAULT))
    out = {"how": "max(bytes floor, decode floor) per step; rates as labelled", "device": {}}
    dev = out["device"]
    dev["bytes_per_s"] = {"value": bw, "label": "measured: 1 GiB copy, read + write"}
    if raw_l2:
        dev["glmctl_decode_rate"] = {"value": raw_l2["weights_per_s"], "label": f"measured: stream {raw_l2['config']}, l2"}
        dev["glmctl_steps"] = step_model(bw, raw_l2["weights_per_s"])
    if raw_dram:
        dev["glmctl_dram_stream_rate"] = {"value": raw_dram["weights_per_s"],
                                          "label": f"measured: stream {raw_dram['config']}, dram (bytes and decode together)"}
        dev["glmctl_dram_steps"] = step_model(bw, raw_dram["weights_per_s"])
    if exl_l2:
        dev["exllamav3_decode_rate"] = {"value": exl_l2["weights_per_s"], "label": f"measured: exl3_gemm {exl_l2['config']}, l2"}
        dev["exllamav3_steps"] = step_model(bw, exl_l2["weights_per_s"])
    if sm90:
        dev["issue_bound_rate_sm90"] = {"value": issue_bound_rate(sm90, sms, clock),
                                        "label": f"predicted: {sm90['instr_per_weight']} SASS/weight at {sms} SMs x {clock / 1e9:.2f} GHz"}
    l40: dict = {"label": "predicted: L40 spec bandwidth 864 GB/s x the copy efficiency measured here "
                          "(copy / spec of this device, when known) and the decode rate measured here (l2) "
                          "scaled by SMs x clock and by the sm_90 / sm_89 SASS counts"}
    spec = {"H200": 4.8e12, "H100": 3.35e12}.get(next((k for k in ("H200", "H100") if k in result["device"]), ""), None)
    eff = bw / spec if spec else 1.0
    l40_bw = L40["dram_bytes_per_s"] * eff
    l40_rate = None
    if raw_l2 and sm90 and sm89 and sm89["instr_per_weight"]:
        l40_rate = (raw_l2["weights_per_s"] * (L40["sms"] * L40["clock_hz"]) / (sms * clock)
                    * sm90["instr_per_weight"] / sm89["instr_per_weight"])
    l40.update(bytes_per_s=l40_bw, decode_rate=l40_rate, steps=step_model(l40_bw, l40_rate))
    out["l40"] = l40
    return out


H200_COPY_BYTES_PER_S = 4_204_025_990_332  # measured: bench/results/moe-hot-h200.json (1 GiB copy, r+w)
ISA_DEVICES = (  # (name, sms, clock, sass arch, bytes per second, what the bandwidth is)
    ("H200", 132, 1.98e9, "sm_90", H200_COPY_BYTES_PER_S, "measured copy (bench/results/moe-hot-h200.json)"),
    ("L40", L40["sms"], L40["clock_hz"], "sm_89", L40["dram_bytes_per_s"], "spec DRAM bandwidth"),
)


def isa_prediction(isa_rows: list[dict]) -> dict:
    """Per device: the issue-bound decode rate of each counted config and the per-step floors at
    the MoE kernels' config, all predicted (SASS counts x spec SMs and max clock)."""
    out = {"label": "predicted: loop SASS per weight (cross-compiled) at full issue, spec SM counts and max "
                    "clocks; bandwidth as labelled per device"}
    for name, sms, clock, arch, bw, bw_label in ISA_DEVICES:
        rates = {r["config"]: issue_bound_rate(r, sms, clock) for r in isa_rows if r["arch"] == arch}
        out[name] = {"bytes_per_s": bw, "bytes_label": bw_label, "issue_bound_rates": rates,
                     "steps": step_model(bw, rates.get(STREAM_DEFAULT))}
    return out

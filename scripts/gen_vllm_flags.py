#!/usr/bin/env python3
"""Write glmctl/serving/vllm_serve_flags.json from the installed vLLM's own `vllm serve` parser.

    python scripts/gen_vllm_flags.py --write    # regenerate (needs vLLM 0.30 importable)
    python scripts/gen_vllm_flags.py --check    # exit 1 if the shipped file differs (the vllm lane)

`glmctl profile validate` reads the file where vLLM is not installed, so `vllm_args` are checked
against vLLM's real option names everywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "glmctl" / "serving" / "vllm_serve_flags.json"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from glmctl.serving.vllm_args import flags_from_vllm

    text = json.dumps(flags_from_vllm().as_json(), indent=1) + "\n"
    if args.write:
        TARGET.write_text(text)
        return 0
    if not TARGET.exists() or TARGET.read_text() != text:
        shipped = json.loads(TARGET.read_text()) if TARGET.exists() else {"options": []}
        live = json.loads(text)
        gone = sorted(set(shipped["options"]) - set(live["options"]))
        new = sorted(set(live["options"]) - set(shipped["options"]))
        print(f"{TARGET.relative_to(ROOT)} is stale for vLLM {live['vllm_version']} (run "
              f"scripts/gen_vllm_flags.py --write): removed {gone[:10]}, added {new[:10]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Print one native_engine JSON result's headline fields on one line (device-call logs)."""

import json
import sys

KEYS = (
    "seqs",
    "decode_tokens_per_s",
    "step_ms",
    "tokens_per_s",
    "mean_running_rows",
    "decode_steps",
    "preemptions",
    "lookahead_rows",
    "decode_kernels",
    "forward_kernels",
    "forward_kernel_us",
    "sampler_kernels",
    "sampler_kernel_us",
    "peak_mem_gb",
)
try:
    with open(sys.argv[1]) as f:
        r = json.load(f)
except ValueError as e:  # a failed run left no JSON: say so, keep the loop going
    print("no result:", e)
    raise SystemExit(0) from None
rows = r.get("results", [r]) if isinstance(r, dict) else r
for row in rows:
    print({k: row.get(k) for k in KEYS if k in row})

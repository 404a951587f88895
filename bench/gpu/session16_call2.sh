#!/bin/bash
# Session 16, device call 2: GRPO end to end with the decode kernels on and off, one
# sitting: grpo-gpu-real (3 steps, 2 timed) and grpo-gpu (continuity). Logs under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
K=stages.engine.roles.rollout.options
step() { name=$1; shift; echo "== $name $*"; timeout 200 python3 -m hybridflow bench step --json "$@" > $OUT/$name.json 2> $OUT/$name.err || tail -5 $OUT/$name.err; python3 -c "
import json,sys; r=json.load(open('$OUT/$name.json')); print({k: v for k, v in r.items() if not isinstance(v, (dict, list))})" 2>&1 | tail -2; }
step real-on --config grpo-gpu-real --set run.steps=3 --set $K.decode_lookahead=${LOOKAHEAD:-false}
step real-off --config grpo-gpu-real --set run.steps=3 --set $K.decode_kernels=false
step gpu-on --config grpo-gpu --set $K.decode_lookahead=${LOOKAHEAD:-false}

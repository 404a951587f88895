#!/bin/bash
# Session 16, device call 2: the native engine's GPU tests (session 15's lookahead and
# non-blocking copies), then GRPO at real shapes with the decode kernels on and off.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
timeout ${TESTS_S:-170} python3 -m pytest -q -p no:cacheprovider -m gpu tests/rollout_native/test_native_gpu.py 2>&1 | tee $OUT/tests_native_gpu.log | tail -12
K=stages.engine.roles.rollout.options
step() { name=$1; shift; echo "== $name $*"; timeout ${STEP_S:-200} python3 -m hybridflow bench step --json "$@" > $OUT/$name.json 2> $OUT/$name.err || tail -5 $OUT/$name.err; python3 -c "
import json; r=json.load(open('$OUT/$name.json')); print({k: v for k, v in r.items() if not isinstance(v, (dict, list))})" 2>&1 | tail -2; }
step real-on --config grpo-gpu-real --set run.steps=3 --set $K.decode_kernels=true --set $K.decode_lookahead=${LOOKAHEAD:-false}
step real-off --config grpo-gpu-real --set run.steps=3

#!/bin/bash
# Session 17, device call 1: the new head log-prob kernel's and session 16's decode
# kernels' GPU tests, then where a qwen2-1.5b actor update goes (issue 25's MFU target):
# compiled layers with the head kernel off (session 12's setting) and on, then packed
# rows with flex_attention.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_models_head_kernel.py tests/rollout_native/test_decode_kernels.py 2>&1 | tee $OUT/tests.log | tail -8
prof() { name=$1; shift; echo "== $name $*"; timeout ${PROF_S:-150} python3 bench/actor_profile.py --steps 2 --top 40 --gemms 16 --set model=qwen2-1.5b "$@" > $OUT/$name.json 2> $OUT/$name.err || tail -4 $OUT/$name.err; python3 -c "
import json; r=json.load(open('$OUT/$name.json')); print({k: v for k, v in r.items() if k not in ('options','top','gemms')})" 2>&1 | tail -2; }
prof p15-nokernel --set compile_layers=true --set logprob_kernel=false
prof p15-kernel --set compile_layers=true
prof p15-flex --set compile_layers=true --set pack_sequences=true --set attn_implementation=flex_attention

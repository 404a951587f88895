#!/bin/bash
# What session 19 could not run (no machine started after its second call), in one call of
# about 9 minutes: grpo-gpu (its first run since logprob_kernel became the default), the
# native engine's and the head kernel's GPU tests (the lookahead, unrun since session 16; a compile_decode that
# falls back now logs inductor's cause), then the qwen2-1.5b variant of grpo-gpu-real,
# new options against old.
#   bash bench/gpu/session19_leftovers.sh      (carry .whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv
echo "== grpo-gpu"
timeout ${GPU_S:-80} python3 -m hybridflow bench step --json --config grpo-gpu --set run.steps=4 > $OUT/grpo-gpu.json 2> $OUT/grpo-gpu.err || tail -5 $OUT/grpo-gpu.err
python3 -c "
import json; r=json.load(open('$OUT/grpo-gpu.json')); print({k: v for k, v in r.items() if not isinstance(v, (dict, list))}); print({k: v['wall_s'] for k, v in r['phases'].items()})"
echo "== native gpu tests, the head kernel's (its probe, added after the last GPU call)"
timeout ${TESTS_S:-130} python3 -m pytest -q -rs tests/rollout_native/test_native_gpu.py tests/models/test_models_head_kernel.py -p no:cacheprovider > $OUT/native_gpu.txt 2>&1
grep -a "compile_decode\|passed\|failed\|Error" $OUT/native_gpu.txt | head -20
unset PYTHONPATH
ORDER="${ORDER:-new15 old15}" STEP_S=${STEP_S:-170} PROFILE= bash bench/gpu/grpo_real_packed.sh

#!/bin/bash
# Session 17, device call 1: the new head log-prob kernel's and session 16's decode
# kernels' GPU tests, then where a qwen2-1.5b actor update goes (issue 25's MFU target):
# compiled layers with the head kernel off (session 12's setting) and on, then packed
# rows with flex_attention.
# Ran once (H100): the first profile on a fresh machine spends most of 120 s compiling,
# so the first of PROFS gets FIRST_S (default 300). Next time, e.g.:
#   TESTS_S=150 MORE_TESTS="tests/stages/test_stages_gpu.py tests/rollout_native" \
#   PROFS="nokernel kernel flex" bash bench/gpu/session17_call1.sh
# Session 18 added packed rows with models/varlen.py (torch's varlen flash kernel):
#   PROFS="nokernel varlen kernel varlen-kernel"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
[ -n "${TESTS-1}" ] && timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_models_head_kernel.py ${MORE_TESTS-tests/rollout_native/test_decode_kernels.py} 2>&1 | tee $OUT/tests.log | tail -8
# An 80 GB card: a budget of 8192 positions (35.3 GB peak on the H100, session 17); session 12's
# 16k real-token groups peaked at 93.6 GB on an H200
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
EXTRA=""; [ "$MEM" -lt 100000 ] && EXTRA="--set max_tokens_per_micro_batch=8192"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
LIMIT=${FIRST_S:-300}
prof() { name=$1; shift; echo "== $name $*"; timeout $LIMIT python3 bench/actor_profile.py --steps ${STEPS:-2} --top 40 --gemms 16 --set model=qwen2-1.5b $EXTRA "$@" > $OUT/$name.json 2> $OUT/$name.err || tail -4 $OUT/$name.err; python3 -c "
import json; r=json.load(open('$OUT/$name.json')); print({k: v for k, v in r.items() if k not in ('options','top','gemms')})" 2>&1 | tail -2; LIMIT=${PROF_S:-150}; }
for p in ${PROFS:-nokernel kernel flex}; do case $p in
  nokernel) prof p15-nokernel --set compile_layers=true --set logprob_kernel=false ;;
  kernel) prof p15-kernel --set compile_layers=true --set logprob_kernel=true ;;
  flex) prof p15-flex --set compile_layers=true --set pack_sequences=true --set attn_implementation=flex_attention --set logprob_kernel=false ;;
  varlen) prof p15-varlen --set compile_layers=true --set pack_sequences=true --set attn_implementation=varlen --set logprob_kernel=false ;;
  varlen-kernel) prof p15-varlen-kernel --set compile_layers=true --set pack_sequences=true --set attn_implementation=varlen --set logprob_kernel=true ;;
  varlen-kernel4k) prof p15-varlen-kernel4k --set compile_layers=true --set pack_sequences=true --set attn_implementation=varlen --set logprob_kernel=true --set logprob_chunk_tokens=4096 ;;
  varlen-kernel4k-16k) prof p15-varlen-kernel4k-16k --set compile_layers=true --set pack_sequences=true --set attn_implementation=varlen --set logprob_kernel=true --set logprob_chunk_tokens=4096 --set max_tokens_per_micro_batch=16384 ;;
  varlen4k) prof p15-varlen4k --set compile_layers=true --set pack_sequences=true --set attn_implementation=varlen --set logprob_chunk_tokens=4096 --set logprob_kernel=false ;;
  kernel-eager) prof p15-kernel-eager --set compile_layers=false --set logprob_kernel=true ;;
  nokernel-eager) prof p15-nokernel-eager --set compile_layers=false --set logprob_kernel=false ;;
  flex-eager) prof p15-flex-eager --set pack_sequences=true --set attn_implementation=flex_attention --set logprob_kernel=false ;;
esac; done

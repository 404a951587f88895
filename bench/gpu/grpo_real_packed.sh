#!/bin/bash
# grpo-gpu-real end to end with session 18's preset (actor and reference packed through
# models/varlen.py, the head kernel in 4096-token chunks) against the same preset with
# those options set back to session 12's (padded rows, 1024-token chunks, the torch head
# passes), alternated in both orders on one machine; then the qwen2-1.5b actor update
# with STEPS timed updates each, to see the spread session 18 found between processes.
# Written in session 18; first run in session 19 (bench/RESULTS.md "Session 19").
#   ORDER="new old old new" STEP_S=240 bash bench/gpu/grpo_real_packed.sh
# (ORDER may also hold new8k: the actor's budget at 8192 positions instead of 16384; and
# new15/old15: the qwen2-1.5b variant)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
git log --oneline -1 | tee -a $OUT/gpu.txt
A=stages.engine.roles.actor.options
R=stages.engine.roles.reference.options
OLD="--set $A.pack_sequences=false --set $A.attn_implementation=sdpa --set $A.logprob_chunk_tokens=1024 --set $A.logprob_kernel=false --set $R.pack_sequences=false --set $R.attn_implementation=sdpa --set $R.logprob_kernel=false"
# the 1.5B variant (the preset's comment), its actor's forwards at 8192 positions to fit 80 GB
B15="--set stages.engine.roles.rollout.options.model=qwen2-1.5b --set $A.model=qwen2-1.5b --set $R.model=qwen2-1.5b --set $A.max_tokens_per_micro_batch=8192"
step() { name=$1; shift; echo "== $name $*"; timeout ${STEP_S:-240} python3 -m hybridflow bench step --json --config grpo-gpu-real --set run.steps=${STEPS_E2E:-3} "$@" > $OUT/$name.json 2> $OUT/$name.err || tail -5 $OUT/$name.err; python3 -c "
import json; r=json.load(open('$OUT/$name.json')); print({k: v for k, v in r.items() if not isinstance(v, (dict, list))})" 2>&1 | tail -2; }
i=0
for o in ${ORDER:-new old old new}; do i=$((i+1)); case $o in
  new) step e2e-$i-new ;;
  old) step e2e-$i-old $OLD ;;
  new8k) step e2e-$i-new8k --set $A.max_tokens_per_micro_batch=8192 ;;  # 16k was slower on an H100
  new15) step e2e-$i-new15 $B15 ;;
  old15) step e2e-$i-old15 $B15 $OLD ;;
esac; done
[ -n "${PROFILE-1}" ] && for p in "--set logprob_kernel=false" "--set logprob_chunk_tokens=4096"; do
  echo "== actor_profile packed varlen $p"
  f=$OUT/prof-$(echo $p | tr -c 'a-z0-9\n' '-').json
  timeout ${PROF_S:-150} python3 bench/actor_profile.py --steps ${STEPS:-5} --top 25 --set model=qwen2-1.5b --set max_tokens_per_micro_batch=8192 --set compile_layers=true --set pack_sequences=true --set attn_implementation=varlen $p > $f 2>/dev/null
  python3 -c "import json; r=json.load(open('$f')); print({k: r[k] for k in ('update_s', 'update_s_all', 'mfu', 'peak_mem_gb')})" 2>&1 | tail -1
done

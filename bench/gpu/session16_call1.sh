#!/bin/bash
# Session 16, device call 1: GPU tests of the new decode kernels and of session 15's work
# (lookahead, non-blocking copies), then decode rows with the kernels off / on, the
# lookahead off / on, Qwen3, and the fixed-budget KV row. Logs under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee $OUT/gpu.txt
git log --oneline -1 | tee -a $OUT/gpu.txt
timeout 200 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/rollout_native/test_decode_kernels.py 2>&1 | tee $OUT/tests_kernels.log | tail -25
E="python3 -m hybridflow.bench.native_engine --json --model qwen2-0.5b --vocab-size 151936 --dtype bfloat16 --seqs 256 --graphs on --frontend sync --paths compiled --kv-cache-gb 24"
run() { echo "== $*"; timeout 100 $E "$@" > /tmp/r.json 2>/tmp/r.err || tail -3 /tmp/r.err; echo "{\"args\": \"$*\", \"result\": $(cat /tmp/r.json || echo null)}" >> $OUT/decode.jsonl; python3 bench/gpu/brief.py /tmp/r.json; }
run --kv-block-size 16 --decode-kernels off
run --kv-block-size 16 --decode-kernels on
run --kv-block-size 16 --decode-kernels on --lookahead on
run --kv-block-size 16 --prompt-len 256 --max-new-tokens 1024 --samples 8 --decode-kernels off
run --kv-block-size 16 --prompt-len 256 --max-new-tokens 1024 --samples 8 --decode-kernels on --lookahead on
run --kv-block-size 16 --model qwen3-0.6b --vocab-size 0 --decode-kernels off
run --kv-block-size 16 --model qwen3-0.6b --vocab-size 0 --decode-kernels on --lookahead on
run --seqs 512 --rows 512 --samples 8 --request-rows 64 --prompt-len 96 --max-new-tokens 1024 --length-median 256 --kv-cache-gb 0.397 --kv-block-size 0
run --seqs 512 --rows 512 --samples 8 --request-rows 64 --prompt-len 96 --max-new-tokens 1024 --length-median 256 --kv-cache-gb 0.397 --kv-block-size 16

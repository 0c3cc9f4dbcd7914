#!/usr/bin/env bash
# One device call (issue 40): the whole fast suite on the GPU (after the float32 cuDNN fix of
# 2026-11-27 it has not run there), then decode's weight layout again, appended to
# docs/results/gpu.md / gpu.jsonl; the tests' whole output in $OUT/tests.txt.
# Usage on the device: KVJAX_COMMIT=<sha> bash scripts/gpu_check.sh   (writes under $OUT)
# On CPU, a try-out: SMALL=1 OUT=/tmp/out bash scripts/gpu_check.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONPATH=.
G="python3 -m kvjax.bench.gpu"; N=32768; T=tests; W=14; S=""
if [ -n "$SMALL" ]; then S=--small; N=1024; T=tests/test_prompt_attention.py; W=2; fi
mkdir -p "$OUT"
cp docs/results/gpu.jsonl docs/results/gpu.md $OUT/
timeout 430 $G $S --append --out $OUT/gpu.md --contexts $N --budget-s 420 \
  --methods full,h2o --steps methods,tests --tests $T --test-workers $W 2>&1 | tee $OUT/log.txt
timeout 100 python3 -m kvjax.bench.decode_layout $S 2>&1 | tee $OUT/decode_layout.txt

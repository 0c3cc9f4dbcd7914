#!/usr/bin/env bash
# One device call (issue 40): decode's weight layout (stacked scan against per-layer
# buffers), then the methods the earlier runs did not reach at 32k and the fast tests on the
# GPU, appended to docs/results/gpu.md / gpu.jsonl.
# Usage on the device: KVJAX_COMMIT=<sha> bash scripts/gpu_check.sh   (writes under $OUT)
# On CPU, a try-out: SMALL=1 OUT=/tmp/out bash scripts/gpu_check.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONPATH=.
G="python3 -m kvjax.bench.gpu"; N=32768; T=tests; W=12; S=""
if [ -n "$SMALL" ]; then S=--small; N=1024; T=tests/test_prompt_attention.py; W=2; fi
mkdir -p "$OUT"
timeout 120 python3 -m kvjax.bench.decode_layout $S 2>&1 | tee $OUT/decode_layout.txt
cp docs/results/gpu.jsonl docs/results/gpu.md $OUT/
timeout 340 $G $S --append --out $OUT/gpu.md --contexts $N --budget-s 330 \
  --methods full,snapkv,streaming_llm,tova,sliminfer_restrict --steps methods,tests \
  --tests $T --test-workers $W 2>&1 | tee $OUT/log.txt

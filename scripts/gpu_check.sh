#!/usr/bin/env bash
# One device call (issue 52): decode over per-layer buffers (the model stored per layer:
# `Model.with_layers`) against the layer scan (stacked), on the 32-layer 8B shape (full cache
# both ways, SnapKV at 1/8 per-layer; 32k batch 1, 8k batch 8, 8k batch 1: % of the
# (weights + live KV) / bandwidth bound); TTFT / full of the methods that
# need column sums (H2O, D2O, ObservedAttention, RoCo) and SlimInfer's step at 32k (4 layers);
# then the fast suite on the GPU; last, the K/V-sized copies in the compiled decode program
# of each layout (`kvjax.bench.decode_hlo`, $OUT/decode_hlo.txt). Appended to
# docs/results/gpu.md / gpu.jsonl; the tests' whole output in $OUT/tests.txt.
# Usage on the device: bash scripts/gpu_check.sh   (writes under $OUT; ~9 minutes)
# On CPU, a try-out: SMALL=1 OUT=/tmp/out bash scripts/gpu_check.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONPATH=.
G="python3 -m kvjax.bench.gpu"; N=32768; RC=32768x1,8192x8,8192x1; T=tests; W=14; S=""
if [ -n "$SMALL" ]; then S=--small; N=1024; RC=1024x1,512x2; T=tests/test_decode_layers.py; W=2; fi
mkdir -p "$OUT"
cp docs/results/gpu.jsonl docs/results/gpu.md $OUT/
timeout 480 $G $S --append --out $OUT/gpu.md --contexts $N --budget-s 460 \
  --roofline-cases $RC --methods full,h2o,d2o,observed_attention,roco,sliminfer \
  --steps roofline,methods,tests --tests $T --test-workers $W 2>&1 | tee $OUT/log.txt
# the decode program's K/V-sized copies per layout (in-place appends?), compiled, not run
timeout 90 python3 -m kvjax.bench.decode_hlo $S 2>&1 | tee $OUT/decode_hlo.txt

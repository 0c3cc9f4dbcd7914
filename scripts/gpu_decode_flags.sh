#!/usr/bin/env bash
# One device call (issue 52, after gpu.md runs 5-7): decode's device and wall time per token
# at 8k x 8 on 16 of the 8B shape's 32 layers (the whole 32 do not fit an 80 GB H100 with
# the per-layer loop's per-generation copy), per-layer loop and scan, without and with the
# XLA flag that may close what the profiles showed: the GPU idle ~1.4 ms a step after the
# loop condition's copy to the host (command buffers capturing the loop); then SlimInfer's
# host-loop step, its device time against its wall time (4 layers, 8k). Before them,
# `kvjax.bench.decode_layout` (~1 minute): per-layer buffers against static slices of the
# stacked arrays. One process per flag set (a flag this XLA does not know stops that
# process only); each appends its run to $OUT/gpu.md. Without flags, the per-layer loop also
# runs with 4 steps between two checks of the stop condition (`Kernels.decode_unroll`): the
# host copy a quarter as often, the other answer to the same gap.
# Usage on the device: KVJAX_COMMIT=<hash> bash scripts/gpu_decode_flags.sh   (~8-9 minutes)
# On CPU, a try-out: SMALL=1 OUT=/tmp/out bash scripts/gpu_decode_flags.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONPATH=.
CASES=8192x8:per_layer,8192x8:scan; UNROLLED=8192x8:per_layer/4; N=8192; S=""; L=16
# and (after it, in the same process) H2O's step, a decode hook, in the scan and over
# per-layer buffers (`Method.layered_hooks`)
SLIM=8192x1:scan:full,8192x1:scan:sliminfer,8192x1:scan:h2o,8192x1:per_layer:h2o
if [ -n "$SMALL" ]; then CASES=512x2:per_layer,512x2:scan; UNROLLED=512x2:per_layer/4
  N=512; S=--small; L=4
  SLIM=512x1:scan:full,512x1:scan:sliminfer,512x1:scan:h2o,512x1:per_layer:h2o; fi
mkdir -p "$OUT"
cp docs/results/gpu.jsonl docs/results/gpu.md $OUT/
# first, the one-step probe: may the loop read static slices of the stacked arrays (no
# per-generation copy), inside a loop as decode runs it?
timeout 90 python3 -m kvjax.bench.decode_layout $S 2>&1 | tee $OUT/decode_layout.txt
for flags in "" \
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"; do
  echo "== XLA_FLAGS='$flags'" | tee -a $OUT/log.txt
  # the unrolled loop only in the first (no flags), with the time it needs
  more=$([ -z "$flags" ] && echo ",$UNROLLED"); t=$([ -z "$flags" ] && echo 200 || echo 150)
  XLA_FLAGS="$flags" timeout $t python3 -m kvjax.bench.gpu $S --append --out $OUT/gpu.md \
    --steps profile --contexts $N --roofline-layers $L --profile-cases $CASES$more \
    --budget-s $((t - 10)) \
    2>&1 | grep -v "^W[0-9]" | tee -a $OUT/log.txt | tail -4
done
# SlimInfer's host-loop step (53x full's at 8k, gpu.md run 1): its device time per token
# against its wall time says whether the GPU computes or waits on the host (the loop's
# syncs and block moves). 4 layers, as run 1. (Dynamic-slice fusion, once tried here,
# changed nothing on the 4-layer shape: docs/results/gpu_targets.md.)
echo "== SlimInfer" | tee -a $OUT/log.txt
timeout 120 python3 -m kvjax.bench.gpu $S --append --out $OUT/gpu.md --steps profile \
  --contexts $N --roofline-layers 4 --profile-cases $SLIM --budget-s 110 \
  2>&1 | grep -v "^W[0-9]" | tee -a $OUT/log.txt | tail -4

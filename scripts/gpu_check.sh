#!/usr/bin/env bash
# One device call: decode variants (A/B on a 4-layer 8B-shaped model at 32k), the decode
# HLO, then the rest of the GPU check appended to docs/results/gpu.jsonl's earlier run.
# Usage on the device: KVJAX_COMMIT=<sha> bash scripts/gpu_check.sh   (writes under $OUT)
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONPATH=.
G="python3 -m kvjax.bench.gpu"; N=32768
if [ -n "$SMALL" ]; then G="$G --small --tests tests/test_prompt_attention.py"; N=1024; fi  # CPU try-out
V="--steps roofline --roofline-layers 4 --roofline-cases ${N}x1 --contexts $N --budget-s 60"
variant() {  # name, then env assignments
  local name=$1; shift
  env "$@" timeout 60 $G $V --out /tmp/v/$name.md >/tmp/v/$name.log 2>&1
  echo "== $name: $*"; grep -A3 "^| run | context | batch" /tmp/v/$name.md | tail -1
  tail -2 /tmp/v/$name.log
}
mkdir -p /tmp/v /tmp/hlo
{
variant base XLA_DUMP=0 "XLA_FLAGS=--xla_dump_to=/tmp/hlo --xla_dump_hlo_module_re=.*decode.*"
variant dsf XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true
variant dsf_cublas "XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_enable_triton_gemm=false"
# (run 2 also timed the decode layer scan unrolled, a switch that existed at e94d912 only)
} 2>&1 | tee $OUT/variants.txt
f=$(ls -S /tmp/hlo/*jit_decode*after_optimizations.txt 2>/dev/null | head -1)
[ -n "$f" ] && gzip -c "$f" > $OUT/decode_hlo.txt.gz
cp docs/results/gpu.jsonl docs/results/gpu.md $OUT/
timeout 310 $G --append --out $OUT/gpu.md --contexts $N --steps methods,xla,tests \
  --budget-s 295 2>&1 | tee $OUT/log.txt

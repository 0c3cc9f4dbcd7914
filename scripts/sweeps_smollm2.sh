#!/usr/bin/env bash
# The SmolLM2-135M sweeps behind MODEL.md's calibration rows and docs/results/pooling.md:
# one JSONL file per sweep, resumable (re-run this script to finish what a stop cut off).
#   nice bash scripts/sweeps_smollm2.sh
set -u
D=docs/results/smollm2
R="python -m kvjax.run --model smollm2-135m --task niah_single --context 1024 --samples 50
   --batch-size 8 --details --no-progress"
sweep() {  # file, then arguments
  local f=$D/$1; shift
  if [ -e "$f" ]; then $R "$@" --output "$f" --resume; else $R "$@" --output "$f"; fi
  python scripts/smollm2_results.py --slim "$f"  # uniform layer_budgets out: docs stay small
}
sweep calib_qa_1024.jsonl --method snapkv,ada_snapkv,h2o,tova,streaming_llm --budget 128,64
# SnapKV's default pooling (max, kernel 7) keeps no needle at 1/8 on this model; kernel 17
# does (docs/results/pooling.md): the claims that need a working SnapKV use it too
sweep pool_snapkv_max_k17_1024.jsonl --method snapkv --budget 128,64 --set kernel=17
sweep calib_co_k17_1024.jsonl --method snapkv --budget 128 --set kernel=17 --scenario context_only
sweep pool_ada_snapkv_max_k17_1024.jsonl --method ada_snapkv --budget 128,64 --set kernel=17
for k in 1 5 11 21; do
  sweep pool_snapkv_max_k${k}_1024.jsonl --method snapkv --budget 128 --set kernel=$k
done
for k in 5 7 17; do
  sweep pool_snapkv_avg_k${k}_1024.jsonl --method snapkv --budget 128 --set kernel=$k --set pooling=avg
done
# 2048: the baselines on one shared prefill per batch (python -m kvjax.run shares it by
# default); SnapKV's family again at kernel 17 (docs/results/pooling.md)
R2=${R/--context 1024/--context 2048}
sweep2() {
  local f=$D/$1; shift
  if [ -e "$f" ]; then $R2 "$@" --output "$f" --resume; else $R2 "$@" --output "$f"; fi
  python scripts/smollm2_results.py --slim "$f" --every-method
}
sweep2 baselines_2048.jsonl --method full,snapkv,ada_snapkv,pyramidkv,h2o,tova,streaming_llm --budget 256,128
sweep2 baselines_k17_2048.jsonl --method snapkv,ada_snapkv,pyramidkv --budget 256,128 --set kernel=17
# LAVa and CAKE against the k17 baselines above; D2O against H2O and StreamingLLM
sweep2 lava_k17_2048.jsonl --method lava,cake --budget 256,128 --set kernel=17
sweep2 d2o_2048.jsonl --method d2o --budget 256,128
# the methods that change the prefill (their own, not shared): SlimInfer and LazyLLM at
# their defaults; ASL, FastKV, GemFilter selecting 256 tokens (1/8)
sweep2 sliminfer_2048.jsonl --method sliminfer,lazyllm
sweep2 asl_2048.jsonl --method asl,fastkv,gemfilter --budget 256

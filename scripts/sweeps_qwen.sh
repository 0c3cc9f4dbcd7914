#!/usr/bin/env bash
# The Qwen2.5-Coder-0.5B sweeps of the papers' claims on RULER (docs/results/*.md, the
# claims registry docs/results/claims.jsonl). One JSONL per sweep in
# docs/results/qwen2.5-coder-0.5b/, resumable: re-run this script (or one line of it) to
# finish what a stop cut off; commit the records as they come.
#   nice bash scripts/sweeps_qwen.sh [SECTION [TASKS]]  # SECTION: baselines (default),
#       pooling, papers, task_kernel, d2o, d2o_ablation, aggregation, critical_co, asl_dev,
#       prefill, asl_variants, perplexity;
#       with MODEL=qwen2.5-coder-1.5b: calibrate, then key;
#       TASKS: a comma list of the solved tasks to run, in that order (default all;
#       aggregation: ruler/cwe)
# A stopped sweep keeps its finished batches (<records>.jsonl.batches, commit them too) and
# the re-run continues from the batch it was in, so a task's ~2 h may span sessions.
#
# Status (n = 50 a cell, RULER's samples 16-65, 4096 tokens; hours on 2 cores):
#   niah_multikey_2: baselines 16 cells done; pooling (dev) 8 done; papers 22 done;
#     asl_dev 1 done (30 min); prefill 5 done (ASL group ~75 min, SlimInfer/LazyLLM ~55 min),
#     SlimInfer/LazyLLM at 512 done 2026-11-29 (~30 min); d2o 12 done 2026-11-29 (RoCo/CaM added);
#     d2o_ablation 3, critical_co 8 and asl_variants 3 done 2026-11-29;
#   vt: baselines 16 cells done 2026-11-29 (7 batches over three sessions, ~25 min a batch
#     beside another sweep, ~15 alone); aggregation 15 done 2026-11-29 (`aggregation ruler/vt`,
#     ~12 min a batch beside another sweep); critical_co 8 done 2026-11-29 (~12 min a batch);
#     d2o 12 done 2026-11-29; papers 12 done 2026-11-29 (the methods the aggregation sweep
#     had not run: CriticalKV's three, HeadKV, D2O, ObservedAttention; 7 batches of ~8.5 min
#     beside the pooling sweep); pooling (vt's own dev samples) 8 done 2026-11-29 (~28 min a
#     kernel beside the papers sweep; vt's dev chooses 7, not niah's 17); task_kernel 16
#     done 2026-11-29 (vt's kernel methods at 7, 41 min, the test suite beside it for 30);
#     cwe: aggregation 14 done 2026-11-29;
#   perplexity: Genesis and essays 15 of 15 runs each (complete 2026-11-29, ~7-18 min a run;
#     one writer per file: a second `perplexity` on the same file stops at once);
#   memory: a Qwen 0.5B sweep holds ~8-9 GB; two of them beside the full test suite were
#     too much for 24 GB (the OOM killer took one, 2026-11-29): one sweep beside the suite;
#   8192: papers on niah_multikey_2 done 2026-11-29 (`CTX=8192 BATCH=8 nice bash
#     scripts/sweeps_qwen.sh papers ruler/niah_multikey_2`: 8 methods x 2 budgets, the SnapKV
#     family from the baselines sweep at the same kernel; 7 batches over two sessions, ~17 min
#     a batch beside the test suite, ~9 min alone, ~14.1 GB RSS: nothing but the suite fits
#     beside it);
#     baselines on niah_multikey_2 done 2026-11-29
#     (`CTX=8192 BATCH=8 nice bash scripts/sweeps_qwen.sh baselines ruler/niah_multikey_2`;
#     the full cache answers 8 of 8 in ruler_8192_n8.jsonl): at BATCH=8 the run held 14.1 GB
#     RSS and took 93 min alone (474 s of shared prefill a batch of 8, ~59 s a sample; 7
#     batches of ~10-13 min), against ~3-3.5 h planned at the default BATCH=4 (the
#     calibration's batch, ~95-100 s a sample); budgets 1/8 and 1/16 of 8192 (1024, 512:
#     every section's budgets are shares of $CTX). Kernel (decided 2026-11-29, before the
#     sweep ran): the SnapKV family at the kernel chosen on the 4096 dev samples
#     (`--qwen-kernel`: 17), not 7: at 7 every one of them sat at 0-12% at 4096, so the 8192
#     comparisons would have read "uninformative"; at 1024 of 8192 PyramidKV's pyramid runs
#     (its first budget above 20 windows), so PyramidKV vs SnapKV is measured (its
#     predictions differed from SnapKV's on 10 of 50). Each method's replay buffers compile
#     to <= 0.3 GB of temporaries at batch 4 (XLA's memory_analysis, 2026-11-29).
#
# Qwen2.5-Coder-1.5B (MODEL=qwen2.5-coder-1.5b; records in docs/results/qwen2.5-coder-1.5b/):
#   a 2048-token sample costs ~73 s of prefill here (MODEL.md), so ~150-200 s at 4096 and a
#   task's shared prefill at n = 50 ~2.5 h. First `calibrate` (the full cache on RULER's
#   samples 0-7 of niah_multikey_2 and cwe, ~25 min a task), then `key` on the tasks it
#   solves (calibrated 2026-11-29, ruler_4096_n8.jsonl: niah_multikey_2 8 of 8, cwe 48%, so
#   `key` runs niah_multikey_2 only (complete 2026-11-29, 7 batches, ~26 min a batch
#   alone, 18.5 GB RSS: nothing else fits beside it); a batch of 8 took 1022 s of prefill
#   and 6.8 s a decode
#   step with a test suite and another sweep beside it): each paper's key comparison at 1/8 of 4096 (512), one shared prefill and 8 cells
#   (~1 h): full, SnapKV, Ada-SnapKV, PyramidKV, H2O, StreamingLLM (the baselines' claims),
#   LAVa (vs Ada-SnapKV), CriticalKV over SnapKV, D2O (vs H2O). Kernel (decided 2026-11-29,
#   before the sweep ran): SnapKV, Ada-SnapKV, LAVa and CriticalKV at the kernel chosen on
#   the 0.5B's dev samples (`--qwen-kernel`: 17; at 7 every one of them sat at 0-12% on the
#   0.5B, so their comparisons would read "uninformative"); a dev pooling sweep of the 1.5B's
#   own would cost another 2.5 h. PyramidKV at 7: at 512 of 4096 its schedule falls back to
#   SnapKV's (below 20 windows of 32; its kept sets equalled SnapKV's on all 50 of the 0.5B's
#   prompts), so its cell is SnapKV at kernel 7, paired with SnapKV at 17 on the same samples:
#   does the needle-span failure shrink with model size? ASL and SlimInfer run their own
#   prefill (~2.5 h each): not in this plan. Declared (QWEN15_PAIRS in smollm2_results.py).
#
# The plan, against the cost measured on this machine (2 cores, float32):
# - the full prefill of a batch of 8 RULER prompts at 4096 tokens: 497 s (62 s a sample,
#   a test suite running beside it; ~40 s alone); decoding 1.1 s a step at batch 8, and a
#   niah answer stops after ~10 tokens (RULER allows 128). A task at n = 50 costs one
#   shared prefill (~35-50 min) plus, per (method, budget) cell, 7 batches of compression
#   and decoding (~3-5 min): the baselines grid below (8 methods x 2 budgets) is ~2 h a
#   task. Fewer tasks, never fewer samples: n = 50 a cell.
# - Tasks: those the full cache solves (>= 80%) in the RULER calibration
#   (ruler_4096*.jsonl, samples 0-15 at most), judged here on other samples: RULER's 16th
#   onwards (--ruler-skip 16; RULER's first samples are the same whatever the count), so
#   the choice of task is not made on the samples it is judged on.
# - Budgets: 512 and 256 of 4096 (1/8 and 1/16). SnapKV's pooling kernel is 7 (its
#   default) unless a kernel chosen on a dev seed does better (the pooling section).
# - Declared comparisons (each a row of claims.jsonl once its records exist): every
#   method against full ("no worse", 5 points), Ada-SnapKV vs SnapKV, Ada-PyramidKV vs
#   PyramidKV, PyramidKV vs SnapKV, SnapKV vs H2O, TOVA and StreamingLLM ("better"), at
#   each budget and task.
# - papers: the five papers' methods that compress after the full prefill, on the same
#   samples and budgets, one shared prefill a task (11 methods x 2 budgets at kernel 17:
#   ~25 min a batch beside other sweeps, ~3 h a task; niah_multikey_2 done 2026-11-28): LAVa, CAKE, HeadKV
#   (kvjax/assets/head_scores/qwen2.5-coder-0.5b.json), CriticalKV over SnapKV, Ada-SnapKV
#   and HeadKV, D2O, ObservedAttention, and the SnapKV family
#   again where the pooling section chose another kernel than 7 (every method with a
#   kernel runs at the chosen one: `--set METHOD.kernel`). Declared comparisons
#   (scripts/smollm2_results.py, QWEN_PAPER_PAIRS): each method no worse than full; LAVa
#   better than Ada-SnapKV, SnapKV, PyramidKV and CAKE; Ada-SnapKV better than SnapKV;
#   critical_snapkv / critical_adakv / critical_headkv better than SnapKV / Ada-SnapKV /
#   HeadKV; HeadKV better than SnapKV and Ada-SnapKV; D2O better than H2O
#   and StreamingLLM (these two from the baselines sweep, same samples).
# - task_kernel (declared 2026-11-29, before it ran; done the same day): vt's own dev
#   samples choose kernel 7 (pooling ruler/vt), where every Qwen sweep ran the kernel
#   methods at niah_multikey_2's 17.
#   On each task whose own dev choice differs: LAVa, CAKE, the two LAVa ablations, HeadKV and
#   CriticalKV over SnapKV, Ada-SnapKV and HeadKV again at that kernel, one shared prefill and
#   16 cells (~70 min alone on vt); the SnapKV family at 7 from the baselines sweep.
#   Declared (QWEN_TASK_KERNEL_PAIRS): the papers' LAVa, CriticalKV and HeadKV comparisons
#   as at 17, each a row of its own (Holm over each paper's comparisons grows with them).
# - d2o: D2O at its paper's own cache shares, 40% and 20% of the prompt (1638 and 819 of
#   4096), where H2O may leave the floor it sits on at 1/8 (6%): D2O, its authors' code
#   reading (d2o_code), H2O and StreamingLLM, one shared prefill (~50 min) and 8 cells of
#   ~10 min: ~2 h a task. Declared (QWEN_D2O_PAIRS): D2O no worse than full; D2O and
#   d2o_code better than H2O and StreamingLLM. Added 2026-11-29, after the sweep ran: RoCo
#   and CaM, the merging baselines of D2O's Table 1 (QWEN_D2O_MERGE_PAIRS: D2O better than
#   each); a re-run (--resume) runs their 4 cells on a new shared prefill, ~1-1.3 h.
# - d2o_ablation: where D2O loses (the d2o section: 16% at 40% against H2O's 24), which of its
#   parts is the cause: d2o_uniform_layers (every layer at the budget, Table 6's "w.o. Layer
#   Operation") and d2o_no_merge (evicted entries discarded), with D2O re-run beside them,
#   at 40% only (20% sits near the floor): one shared prefill and 3 cells, ~1 h. Declared
#   (QWEN_D2O_ABLATION_PAIRS): D2O better than each ablation.
# - aggregation: LAVa's claim where its paper says dynamic layer budgets matter most, RULER's
#   aggregation: cwe (the full cache writes ~65% of the references at 4096 in the
#   calibration: not "solved", but off the floor and the ceiling; scored by the share
#   written, judged by a paired sign-flip test), TASKS defaulting to ruler/cwe. Full, SnapKV,
#   Ada-SnapKV, PyramidKV, LAVa, CAKE and the ablations lava_heads_only / lava_layers_only
#   at 1/8 and 1/16, kernel as chosen: one shared prefill (~60 min) and 14 cells of ~8 min
#   (cwe writes up to 120 tokens): ~2.5-3 h. Declared (QWEN_LAVA_TASK_PAIRS): as papers'
#   LAVa pairs, and LAVa better than each ablation.
# - critical_co: CriticalKV in its paper's setting, context-only (the context compressed before
#   the question is seen), at 1/2 and 2/5 of the context (2048 and 1638), where SmolLM2's
#   Ada-SnapKV left the floor it sits on at 1/4 and 1/8: SnapKV, Ada-SnapKV and their critical
#   forms at the kernel chosen, one shared prefill (~40 min) and 8 cells of ~6 min: ~1.5 h.
#   Declared (QWEN_CRITICAL_CO_PAIRS): critical_snapkv better than SnapKV, critical_adakv
#   better than Ada-SnapKV.
# - perplexity: D2O's long-text claim (its PG-19 measurement) as on SmolLM2: Genesis and
#   RULER's essays, the first 512 of 2048 tokens prefilled into each cache at rho 0.2 and
#   0.4, the other 1536 fed one at a time; full, StreamingLLM, H2O, D2O, RoCo and CaM (11
#   runs a text; SmolLM2 took 3 min a run, this model ~4x: ~2-2.5 h a text). Declared
#   (PPL_CLAIMS, smollm2_results.py): D2O better than H2O, StreamingLLM, RoCo and CaM,
#   judged over 128-token blocks. Added 2026-11-29, once D2O read 99 / 125 at rho 0.2 / 0.4
#   against H2O's 18 / 16 on Genesis (Eq. 5's softmax over the raw variances gave 12 of 24
#   layers the floor of 6 entries there): D2O with uniform layer budgets
#   (`d2o:variance_layers=false`; PPL_CLAIMS' D2O vs it), which took SmolLM2's D2O from
#   15.9 to 7.9, and the authors' code reading (`d2o_code`: min-max normalised variances;
#   better than H2O and StreamingLLM, declared), 4 runs a text.
# - asl_dev: ASL's relative rank variance on the dev samples at tau = 1e-6 (never selects),
#   its own prefill, ~50 min; the rule that reads it (`smollm2_results.py --qwen-asl`,
#   declared before it ran): the defaults if >= 25 of 50 prompts select at tau 0.3, else
#   ranks from L_min (SmolLM2's dev choice).
# - prefill: the methods that change the prefill itself, each its own prefill (~40 min a
#   method at n = 50 alone, ~3.5 h a task): ASL, FastKV and GemFilter selecting 512 tokens
#   (1/8); SlimInfer and LazyLLM keeping 1024, 512 and 256 tokens after their three pruning
#   layers (`--budget 256`: the paper's 8k, 4k, 2k of 32k scaled to 4096, 16/8/4 blocks of
#   64, which is also SlimInfer's default here: kvjax's 3-block floor does not bind), and
#   (added 2026-11-29, after both sat at the floor there: 10% and 0%) 2048, 1024 and 512
#   (`--budget 512`, twice the paper's shares), where the mechanism can be told from
#   LazyLLM's (~40 min more: SlimInfer's host-offloaded decode takes ~20 s a step).
#   Declared: ASL better than FastKV and GemFilter and no worse than full; SlimInfer and
#   LazyLLM no worse than full, SlimInfer better than LazyLLM.
# - asl_variants: the paper's two other forms of ASL on prefill's samples, reading and kernel,
#   each its own prefill (~40 min a method alone at n = 50: ~1.5 h a task): asl_2pass (ASL's
#   selection, then the model again from layer 0 on the selected tokens, as GemFilter) and
#   asl_full_before (the full KV up to the selection layer); and (added 2026-11-29, before
#   it ran) FastKV at ASL's live KV: tsp_rate 0.125, 512 of 4096 tokens propagated (at its
#   default 0.2 it kept 0.171 of the KV against ASL's 0.131), ~40 min more. Declared
#   (QWEN_ASL_VARIANT_PAIRS): asl_2pass better than GemFilter, asl_full_before better than
#   ASL (the full KV before the selection should only help), ASL better than FastKV at
#   equal KV.
set -u
cd "$(dirname "$0")/.."
MODEL=${MODEL:-qwen2.5-coder-0.5b}  # MODEL=qwen2.5-coder-1.5b: the calibrate and key sections
D=docs/results/$MODEL
CTX=${CTX:-4096}  # CTX=8192 for the second length (its own calibration: ruler_8192*.jsonl)
BATCH=${BATCH:-$([ "$CTX" -gt 4096 ] && echo 4 || echo 8)}  # 8192: the calibration's batch
B8=$((CTX / 8)) B16=$((CTX / 16))  # the budgets 1/8 and 1/16 (512 and 256 of 4096)
R="python -m kvjax.run --model $MODEL --context $CTX --samples 50 --ruler-skip 16
   --batch-size $BATCH --details --no-progress"

solved() {  # the RULER tasks the full cache solves at $CTX in the calibration records
  python - "$D" "$CTX" <<'EOF'
import json, sys
from pathlib import Path
best = {}
for f in sorted(Path(sys.argv[1]).glob(f"ruler_{sys.argv[2]}*.jsonl")):
    for line in f.read_text().splitlines():
        r = json.loads(line)
        if r["method"] == "full" and r["samples"] >= best.get(r["task"], (0, 0))[0]:
            best[r["task"]] = (r["samples"], r["accuracy"])
print(",".join(t for t, (n, a) in best.items() if a >= 0.8))
EOF
}

run() {  # file, then arguments; the records (or a stopped sweep's batches) slimmed after
  local f=$D/$1; shift
  if [ -e "$f" ] || [ -e "$f.batches" ]; then $R "$@" --output "$f" --resume; else $R "$@" --output "$f"; fi
  # LazyLLM's per-token kept sets (up to 30 KB a sample) say nothing the pages read
  # nor D2O's per-sample thresholds (tau0: 8 KB a batch on vt) nor LAVa's layer weights
  local every=(); case $f in */prefill_slim_*|*/d2o_*|*/papers_*|*/kernel*_*|*/lava_*) every=(--every-method) ;; esac
  for g in "$f" "$f.batches"; do
    [ -e "$g" ] && python scripts/smollm2_results.py "${every[@]}" --slim "$g"
  done
  true
}

case "$MODEL:${1:-baselines}" in  # the 0.5B's sections read its dev choices (kernel, ASL)
  qwen2.5-coder-0.5b:*|*:calibrate|*:key) ;;
  *) echo "section ${1:-baselines} is the 0.5B model's; with MODEL=$MODEL: calibrate or key" >&2
     exit 2 ;;
esac
if [ "${1:-}" = calibrate ]; then  # the full cache on RULER's samples 0-7 of the tasks
  # judged on the 0.5B model (TASKS: niah_multikey_2 and cwe): ruler_<CTX>_n8.jsonl
  exec python scripts/llm_card.py --model "$MODEL" --measure "ruler:$CTX" --samples 8 \
    --tag n8 --ruler-tasks "${2:-ruler/niah_multikey_2,ruler/cwe}"
fi
TASKS=$(solved)
[ -n "$TASKS" ] || { echo "no calibration records with a solved task in $D" >&2; exit 2; }
if [ -n "${2:-}" ] && [ "${1:-}" != aggregation ]; then
  for t in ${2//,/ }; do
    [[ ",$TASKS," == *",$t,"* ]] || { echo "$t is not a solved task here ($TASKS)" >&2; exit 2; }
  done
  TASKS=$2
fi
case "${1:-baselines}" in
  baselines)  # at 4096 the kernel methods at their default 7 (as this sweep first ran); at
    # longer contexts at the dev-chosen kernel (7 left them at 0-12% at 4096: uninformative)
    SETS=()
    if [ "$CTX" != 4096 ]; then
      K=$(python scripts/smollm2_results.py --qwen-kernel) || exit 2
      for m in snapkv ada_snapkv pyramidkv ada_pyramidkv; do SETS+=(--set "$m.kernel=$K"); done
    fi
    for t in ${TASKS//,/ }; do
      run "baselines_${t#ruler/}_$CTX.jsonl" --task "$t" --budget $B8,$B16 \
        --method full,snapkv,ada_snapkv,pyramidkv,ada_pyramidkv,h2o,tova,streaming_llm "${SETS[@]}"
    done ;;
  pooling)  # SnapKV's kernel chosen on a dev seed: RULER's samples 66-115, judged elsewhere
    for t in ${TASKS//,/ }; do
      for k in 7 17; do
        R=${R/--ruler-skip 16/--ruler-skip 66} run "dev_pool_k${k}_${t#ruler/}_$CTX.jsonl" \
          --task "$t" --budget $B8,$B16 --method snapkv,ada_snapkv --set kernel=$k
      done
    done ;;
  papers)  # the cells another sweep of the same samples has at the chosen kernel are not
    # run twice: LAVa, CAKE and the SnapKV family where the aggregation sweep ran the task
    # (lava_<task>), the SnapKV family at longer contexts (the baselines sweep ran it there)
    K=$(python scripts/smollm2_results.py --qwen-kernel) || exit 2
    M=lava,cake,critical_snapkv,critical_adakv,headkv,critical_headkv,d2o,observed_attention
    [ "$K" != 7 ] && [ "$CTX" = 4096 ] && M=snapkv,ada_snapkv,pyramidkv,$M
    for t in ${TASKS//,/ }; do
      MT=() SETS=()
      for m in ${M//,/ }; do
        if [ -e "$D/lava_${t#ruler/}_$CTX.jsonl" ]; then
          case $m in snapkv|ada_snapkv|pyramidkv|lava|cake) continue ;; esac
        fi
        MT+=("$m")
        case $m in d2o|observed_attention) ;; *) SETS+=(--set "$m.kernel=$K") ;; esac
      done
      M1=${MT[*]}
      run "papers_${t#ruler/}_$CTX.jsonl" --task "$t" --budget $B8,$B16 --method "${M1// /,}" \
        "${SETS[@]}"
    done ;;
  task_kernel)  # each task whose own dev samples (the pooling section run on it) choose
    # another kernel than niah_multikey_2's, which the sections above use: the papers' kernel
    # methods on it again at the task's own kernel (the SnapKV family at 7 is the baselines
    # sweep's; at another kernel it runs here too)
    K=$(python scripts/smollm2_results.py --qwen-kernel) || exit 2
    for t in ${TASKS//,/ }; do
      KT=$(python scripts/smollm2_results.py --qwen-kernel "${t#ruler/}") || {
        echo "$t: skipped (no kernel of its own: \`pooling $t\` first)" >&2; continue; }
      [ "$KT" = "$K" ] && { echo "$t: its dev samples choose kernel $K too: skipped" >&2; continue; }
      M=lava,cake,lava_heads_only,lava_layers_only,critical_snapkv,critical_adakv,headkv,critical_headkv
      # the baselines sweep ran the SnapKV family at 7 at 4096 only
      [ "$KT" = 7 ] && [ "$CTX" = 4096 ] || M=snapkv,ada_snapkv,pyramidkv,$M
      run "kernel${KT}_${t#ruler/}_$CTX.jsonl" --task "$t" --budget $B8,$B16 --method "$M" \
        --set kernel=$KT
    done ;;
  d2o)
    for t in ${TASKS//,/ }; do
      run "d2o_${t#ruler/}_$CTX.jsonl" --task "$t" --budget $((CTX * 2 / 5)),$((CTX / 5)) \
        --method d2o,d2o_code,h2o,streaming_llm,roco,cam
    done ;;
  d2o_ablation)
    for t in ${TASKS//,/ }; do
      run "ablation_d2o_${t#ruler/}_$CTX.jsonl" --task "$t" --budget $((CTX * 2 / 5)) \
        --method d2o,d2o_uniform_layers,d2o_no_merge
    done ;;
  aggregation)
    K=$(python scripts/smollm2_results.py --qwen-kernel) || exit 2
    M=full,snapkv,ada_snapkv,pyramidkv,lava,cake,lava_heads_only,lava_layers_only
    SETS=()
    for m in ${M//,/ }; do [ $m = full ] || SETS+=(--set "$m.kernel=$K"); done
    T=${2:-ruler/cwe}
    for t in ${T//,/ }; do
      run "lava_${t#ruler/}_$CTX.jsonl" --task "$t" --budget $B8,$B16 --method "$M" "${SETS[@]}"
    done ;;
  critical_co)
    K=$(python scripts/smollm2_results.py --qwen-kernel) || exit 2
    for t in ${TASKS//,/ }; do
      run "critical_co_${t#ruler/}_$CTX.jsonl" --task "$t" --budget $((CTX / 2)),$((CTX * 2 / 5)) --scenario context_only \
        --method snapkv,ada_snapkv,critical_snapkv,critical_adakv --set kernel=$K
    done ;;
  asl_dev)  # ASL's relative rank variance on the dev samples, tau = 1e-6: it never selects,
    # so every layer's value is recorded and the prompts any tau would select follow from it;
    # the paper's code's reading (ranks from layer 0). `--qwen-asl` reads it for prefill.
    K=$(python scripts/smollm2_results.py --qwen-kernel) || exit 2
    for t in ${TASKS//,/ }; do
      R=${R/--ruler-skip 16/--ruler-skip 66} run "dev_asl_default_${t#ruler/}_$CTX.jsonl" \
        --task "$t" --budget $B8 --method asl --set kernel=$K --set tau=1e-6
    done ;;
  prefill)
    K=$(python scripts/smollm2_results.py --qwen-kernel) || exit 2
    A=$(python scripts/smollm2_results.py --qwen-asl) || exit 2
    for t in ${TASKS//,/ }; do
      run "prefill_asl_${t#ruler/}_$CTX.jsonl" --task "$t" --budget $B8 --method asl,fastkv,gemfilter \
        --set asl.kernel=$K --set fastkv.kernel=$K --set gemfilter.kernel=$K $A
      run "prefill_slim_${t#ruler/}_$CTX.jsonl" --task "$t" --budget $B16,$B8 --method sliminfer,lazyllm
    done ;;
  asl_variants)  # the paper's other forms of ASL, each its own prefill, on prefill_asl's
    # samples, reading and kernel; and FastKV propagating 1/8 of the prompt (tsp_rate 0.125),
    # so its live KV is ASL's (as SmolLM2's asl_eqkv)
    K=$(python scripts/smollm2_results.py --qwen-kernel) || exit 2
    A=$(python scripts/smollm2_results.py --qwen-asl) || exit 2
    for t in ${TASKS//,/ }; do
      run "asl_variants_${t#ruler/}_$CTX.jsonl" --task "$t" --budget $B8 \
        --method asl_2pass,asl_full_before,fastkv --set kernel=$K \
        ${A//asl./asl_2pass.} ${A//asl./asl_full_before.} --set fastkv.tsp_rate=0.125
    done ;;
  perplexity)  # D2O's long-text claim: teacher-forced perplexity, one text a run
    for text in genesis essays; do
      python scripts/d2o_results.py --model "$MODEL" --ppl-only "$D/d2o_ppl_$text.jsonl" \
        --ppl-text $text --ppl-tokens 2048 --prompt 512 --ratios 0.2,0.4 \
        --methods full,streaming_llm,h2o,d2o,d2o:variance_layers=false,d2o_code,roco,cam
    done ;;
  key)  # a larger model (MODEL=qwen2.5-coder-1.5b): each paper's key comparison at 1/8, the
    # kernel methods at the 0.5B's dev-chosen kernel; PyramidKV at 7: at 1/8 of 4096 it is
    # SnapKV's rule (its fallback below 20 windows), so its cell is SnapKV at kernel 7
    K=$(python scripts/smollm2_results.py --qwen-kernel) || exit 2
    SETS=()
    for m in snapkv ada_snapkv lava critical_snapkv; do SETS+=(--set "$m.kernel=$K"); done
    for t in ${TASKS//,/ }; do
      run "key_${t#ruler/}_$CTX.jsonl" --task "$t" --budget $B8 \
        --method full,snapkv,ada_snapkv,pyramidkv,h2o,streaming_llm,lava,critical_snapkv,d2o \
        "${SETS[@]}" --set pyramidkv.kernel=7
    done ;;
  *) echo "unknown section $1: calibrate, baselines, pooling, papers, task_kernel, d2o, d2o_ablation, aggregation, critical_co, asl_dev, prefill, asl_variants, perplexity or key" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# The GPU runs behind docs/perf-notes.md and docs/results/, one stage (a case below) per argument, each a 10-minute
# command: `OUT=runs/gpu bash scripts/gpu_runs.sh STAGE...` (allreduce/ddp/sharding/leaderboard-2026*/fsdp*/tests-fsdp/tests-nccl need 2-4 GPUs)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
BENCH=(python3 -m pytest -p no:cacheprovider -q --benchmark-columns=mean,stddev,rounds)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) python3 -m pytest tests -p no:cacheprovider -q -m gpu --ignore=tests/test_flash_attention.py --ignore=tests/test_flash_gluon.py 2>&1 | tail -15 ;;
    tests-attention)  # the FlashAttention and weighted-sum tests
      python3 -m pytest tests/test_flash_attention.py tests/test_flash_gluon.py tests/test_weighted_sum.py tests/test_flash_tune_table.py -p no:cacheprovider -q -n 4 2>&1 | tail -8 ;;
    memory)  # issue 16: the fused kernels' tests on the GPU, then D22 checkpointing, fused loss, fused AdamW
      python3 -m pytest tests/test_fused_cross_entropy.py tests/test_fused_adamw.py tests/test_checkpointing.py \
        -p no:cacheprovider -q -k "not compiled and not every_attention" 2>&1 | tail -8
      "${BENCH[@]}" bench/bench_memory.py --benchmark-json="$OUT/memory.json" > "$OUT/memory.log" 2>&1
      tail -4 "$OUT/memory.log"; python3 -m cs336_systems.report "$OUT/memory.json" --out "$OUT/report-memory" > /dev/null ;;
    model-core)  # D2/D4/D7b: small and medium at ctx 256, every mode/dtype, eager and compiled; warm-up study
      "${BENCH[@]}" bench/bench_model.py::test_model bench/bench_model.py::test_warmup \
        --only size=small,medium --only ctx=256 --benchmark-json="$OUT/model-core.json" 2>&1 | tail -60
      # xl at ctx 512, bf16, forward and forward+backward, compiled: the SPEC's reference figures
      CS336_FULL_GRID=1 "${BENCH[@]}" bench/bench_model.py::test_model -k "xl-ctx512-bf16 and compiled and not train" \
        --benchmark-json="$OUT/model-xl-ref.json" 2>&1 | tail -12 ;;
    model-xl-mem)  # D2 xl bf16 train at ctx 512 (MFU); D5 2.7B peak memory
      "${BENCH[@]}" bench/bench_model.py -k "xl-ctx512-bf16-train or test_memory" --benchmark-json="$OUT/model-xl-mem.json" 2>&1 | tail -40 ;;
    profile)  # D3 kernel summary + Chrome trace; D5 memory snapshots (gzipped pickles)
      python3 -m cs336_systems.cli.benchmark --size medium --context 256 --mode train --warmup 2 --steps 3 \
        --profile "$OUT/profile" 2>&1 | tail -60
      python3 -m cs336_systems.cli.benchmark --size 2.7B --context 256 --mode fwd train --warmup 1 --steps 2 \
        --no-mfu --memory-snapshot "$OUT/mem.pickle" 2>&1 | tail -12
      gzip -f "$OUT"/*.pickle ;;
    attention)  # D6 / D7a
      CS336_BENCH_JSONL=$OUT/attention.jsonl "${BENCH[@]}" bench/bench_attention.py \
        --benchmark-json="$OUT/attention.json" > "$OUT/attention.log" 2>&1
      tail -3 "$OUT/attention.log"
      python3 -m cs336_systems.report "$OUT/attention.jsonl" --out "$OUT/attention-report" > /dev/null
      head -40 "$OUT"/attention-report/tables/d6*.md ;;
    flash)  # D11 at d 64 and 128: bf16 every seq (and the D12 leaderboard group), fp32 to 16384; .jsonl: rows so far
      CS336_BENCH_JSONL=$OUT/flash.jsonl "${BENCH[@]}" bench/bench_flash.py --only d=64,128 --only dtype=bf16 \
        --benchmark-json="$OUT/flash-bf16.json" > "$OUT/flash-bf16.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/flash-bf16.log" | tail -8
      CS336_BENCH_JSONL=$OUT/flash.jsonl "${BENCH[@]}" bench/bench_flash.py --only d=64,128 --only dtype=fp32 \
        --only seq=128,256,512,1024,2048,4096,8192,16384 -k "not leaderboard" \
        --benchmark-json="$OUT/flash-fp32.json" > "$OUT/flash-fp32.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/flash-fp32.log" | tail -8 ;;
    flash-shapes)  # issue 14: the attention shapes grid (ours vs SDPA flash / cuDNN / mem-efficient), ~3 min
      CS336_BENCH_JSONL=$OUT/flash-shapes.jsonl "${BENCH[@]}" bench/bench_flash.py -k attention_shapes \
        --benchmark-json="$OUT/flash-shapes.json" > "$OUT/flash-shapes.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/flash-shapes.log" | tail -8
      python3 -m cs336_systems.report "$OUT/flash-shapes.json" --out "$OUT/report-flash-shapes" > /dev/null ;;
    flash-leaderboard)  # D12 / issue 14: the leaderboard case, ours beside SDPA flash and cuDNN (~1 min)
      "${BENCH[@]}" bench/bench_flash.py -k "leaderboard and (flash_triton or sdpa)" \
        --benchmark-json="$OUT/flash-leaderboard.json" 2>&1 | tail -8 ;;
    flash-compare)  # a refactor's proof: the revision REV (default main's parent) against this tree, interleaved
      # (attention shapes group + leaderboard; needs .ab/old from `python3 scripts/compare_revisions.py export REV .ab/old`)
      PYTHONPATH=src:.ab/old python3 scripts/compare_revisions.py run --out "$OUT/compare-revisions.json" 2>&1 \
        | grep -v -i warn | tail -20 ;;
    flash-tune)  # this GPU's shipped tuning table (kernels/flash/tuned/<device>.json): the grid and the model's keys (~1 min)
      python3 -m cs336_systems.cli.flash_tune --shapes model,grid > "$OUT/flash-tune.log" 2>&1
      tail -3 "$OUT/flash-tune.log"; cp src/cs336_systems/kernels/flash/tuned/*.json "$OUT/" ;;
    cold-start)  # the compiled xl step (ctx 512, bf16, fwd_bwd) from empty Triton/inductor caches: sdpa vs flash_triton
      for attn in sdpa flash_triton; do
        rm -rf /tmp/cold-tc /tmp/cold-ic; s=$(date +%s)
        TRITON_CACHE_DIR=/tmp/cold-tc TORCHINDUCTOR_CACHE_DIR=/tmp/cold-ic python3 -m cs336_systems.cli.benchmark \
          --size xl --context 512 --mode fwd_bwd --dtype bf16 --compile --attention $attn --warmup 1 --steps 10 \
          --no-mfu > "$OUT/cold-$attn.log" 2>&1
        echo "cold start $attn: rc=$? $(( $(date +%s) - s )) s"; tail -3 "$OUT/cold-$attn.log"
      done ;;
    model-attention)  # issue 14: small and xl, ctx 512, bf16, fwd_bwd, eager and compiled, sdpa vs flash_triton (4 compiles)
      CS336_FULL_GRID=1 "${BENCH[@]}" bench/bench_model.py::test_model --only size=small,xl --only ctx=512 \
        --only dtype=bf16 --only mode=fwd_bwd --only compile=compiled,eager --only attention=sdpa,flash_triton \
        --benchmark-json="$OUT/model-attention.json" 2>&1 | tail -12 ;;
    model-attention-cudagraphs)  # issue 14: small and xl, ctx 512, bf16, fwd_bwd, CUDA-graphed: bench rows, then paired (8 compiles)
      CS336_FULL_GRID=1 "${BENCH[@]}" bench/bench_model.py::test_model --only size=small,xl --only ctx=512 \
        --only dtype=bf16 --only mode=fwd_bwd --only compile=cudagraphs --only attention=sdpa,flash_triton \
        --benchmark-json="$OUT/model-attention-cudagraphs.json" 2>&1 | tail -8 ;;
    allreduce)  # D13: nccl at 2 and 4 GPUs (6 needs an 8-GPU machine), 1 MB .. 1 GB
      "${BENCH[@]}" bench/bench_allreduce.py --only backend=nccl --benchmark-json="$OUT/allreduce.json" 2>&1 | tail -30 ;;
    ddp)  # D14-D17 + torch DDP, xl, 2 GPUs
      CUDA_VISIBLE_DEVICES=0,1 CS336_TRACE_DIR=$OUT/traces "${BENCH[@]}" bench/bench_ddp.py --benchmark-json="$OUT/ddp.json" 2>&1 | tail -30 ;;
    sharding)  # D20 + torch ZeroRedundancyOptimizer, xl, 2 GPUs
      CUDA_VISIBLE_DEVICES=0,1 "${BENCH[@]}" bench/bench_sharding.py --benchmark-json="$OUT/sharding.json" 2>&1 | tail -20 ;;
    leaderboard-2026)  # D26: the 8B step, ours vs torch's built-ins, eager and block-compiled (~7 min)
      CUDA_VISIBLE_DEVICES=0,1 CS336_BENCH_JSONL=$OUT/leaderboard_2026.jsonl "${BENCH[@]}" -s \
        bench/bench_leaderboard_2026.py -k "not ablation" --benchmark-json="$OUT/leaderboard_2026.json" \
        > "$OUT/leaderboard_2026.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/leaderboard_2026.log" | tail -8
      python3 -m cs336_systems.report "$OUT/leaderboard_2026.jsonl" --format md --out "$OUT/report-leaderboard_2026" > /dev/null ;;
    leaderboard-2026-ablation)  # D26: ours with one piece swapped for torch's, eager (~4 min)
      CUDA_VISIBLE_DEVICES=0,1 CS336_BENCH_JSONL=$OUT/leaderboard_2026.jsonl "${BENCH[@]}" -s \
        bench/bench_leaderboard_2026.py -k "ours-eager or ablation" \
        --benchmark-json="$OUT/leaderboard_2026_ablation.json" > "$OUT/leaderboard_2026_ablation.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/leaderboard_2026_ablation.log" | tail -8
      python3 -m cs336_systems.report "$OUT/leaderboard_2026.jsonl" --format md --out "$OUT/report-leaderboard_2026" > /dev/null ;;
    leaderboard-2026-keep)  # D26: ours compiled keep:auto vs built-ins compiled, then ours at keep 0/8/auto (~6 min)
      CUDA_VISIBLE_DEVICES=0,1 CS336_BENCH_JSONL=$OUT/leaderboard_2026_keep.jsonl CS336_8B_ABLATION_COMPILE=1 \
        CS336_8B_KEEP=${CS336_8B_KEEP:-0,8,auto} CS336_8B_TIMEOUT_S=${CS336_8B_TIMEOUT_S:-180} \
        CS336_FLASH_TUNE_CACHE=${CS336_FLASH_TUNE_CACHE:-/tmp/flash_tune.json} "${BENCH[@]}" -s \
        bench/bench_leaderboard_2026.py -k "compiled or ablation_keep" \
        --benchmark-json="$OUT/leaderboard_2026_keep.json" > "$OUT/leaderboard_2026_keep.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed|Error|^checkpoint keep|^peak GiB|^step s" "$OUT/leaderboard_2026_keep.log" | tail -24
      python3 -m cs336_systems.report "$OUT/leaderboard_2026_keep.jsonl" --format md --out "$OUT/report-leaderboard_2026_keep" > /dev/null ;;
    fsdp)  # D23/D24(b): xl ctx 512, ours vs FSDP2 vs DDP (individual), fp32 and bf16, 2 GPUs (~2 min)
      CUDA_VISIBLE_DEVICES=0,1 "${BENCH[@]}" bench/bench_fsdp.py --benchmark-json="$OUT/fsdp.json" 2>&1 | tail -20 ;;
    fsdp-blocks)  # issue 15 headline: ours vs FSDP2 per block and DDP, fp32 and bf16, traces kept (~1.5 min)
      CUDA_VISIBLE_DEVICES=0,1 CS336_DDP_WARMUP=2 CS336_DDP_STEPS=5 CS336_TRACE_DIR=$OUT/traces "${BENCH[@]}" -s \
        bench/bench_fsdp.py -k "blocks or individual" --benchmark-json="$OUT/fsdp-blocks.json" \
        > "$OUT/fsdp-blocks.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/fsdp-blocks.log" | tail -4 ;;
    leaderboard-2026-compiled)  # D26 headline: ours compiled keep:auto vs built-ins compiled, same run (~2.5 min)
      CUDA_VISIBLE_DEVICES=0,1 CS336_BENCH_JSONL=$OUT/leaderboard_2026.jsonl CS336_8B_TIMEOUT_S=170 \
        CS336_FLASH_TUNE_CACHE=/tmp/flash_tune.json "${BENCH[@]}" -s bench/bench_leaderboard_2026.py \
        -k "compiled and not ablation" --benchmark-json="$OUT/leaderboard_2026.json" > "$OUT/leaderboard_2026.log" 2>&1
      python3 -m cs336_systems.report "$OUT/leaderboard_2026.jsonl" --format md --out "$OUT/report-leaderboard_2026" > /dev/null ;;
    leaderboard-2026-course)  # issue 50: ours vs built-ins compiled with the course's do_bench, then ours with the optimizer in backward / attention re-run (~8 min)
      CUDA_VISIBLE_DEVICES=0,1 CS336_BENCH_JSONL=$OUT/leaderboard_2026_course.jsonl CS336_8B_TIMEOUT_S=170 CS336_8B_COURSE=1 \
        CS336_8B_ABLATION_COMPILE=1 CS336_8B_ABLATION_STEPS=3 CS336_FLASH_TUNE_CACHE=/tmp/flash_tune.json \
        timeout ${CS336_STAGE_TIMEOUT_S:-530} "${BENCH[@]}" -s bench/bench_leaderboard_2026.py \
        -k "(compiled and not ablation) or optimizer_in_backward or full_recompute" \
        --benchmark-json="$OUT/leaderboard_2026_course.json" > "$OUT/leaderboard_2026_course.log" 2>&1
      echo "pytest rc=$?"
      grep -E "^fsdp=|^step s|^model TFLOP|^course protocol|^peak GiB|^first finished|^cold start|^optimizer in backward|^checkpoint keep|^device ms|^OOM|^failed|^(FAILED|ERROR)|passed|failed" "$OUT/leaderboard_2026_course.log"
      python3 -m cs336_systems.report "$OUT/leaderboard_2026_course.jsonl" --format md --out "$OUT/report-leaderboard_2026_course" > /dev/null ;;
    proxy-8b)  # issue 37: the 8B step's one-GPU proxy (4 blocks, ctx 32,768, compiled): ours, torch, one-piece swaps
      CUDA_VISIBLE_DEVICES=0 CS336_BENCH_JSONL=$OUT/proxy_8b.jsonl CS336_FLASH_TUNE_CACHE=$(mktemp -d)/flash_tune.json \
        "${BENCH[@]}" -s bench/bench_8b_proxy.py --benchmark-json="$OUT/proxy_8b.json" > "$OUT/proxy_8b.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed|Error|^step s|^model TFLOP|^peak GiB|^first finished|^OOM" "$OUT/proxy_8b.log"
      python3 -m cs336_systems.report "$OUT/proxy_8b.json" --out "$OUT/proxy_8b-report" > /dev/null ;;
    tests-fsdp) CUDA_VISIBLE_DEVICES=0,1 python3 -m pytest -p no:cacheprovider -q -m gpu tests -k fsdp 2>&1 | tail -8 ;;  # nccl, 2 GPUs
    tests-nccl) CUDA_VISIBLE_DEVICES=0,1 python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_ddp.py tests/test_sharded_optimizer.py 2>&1 | tail -5 ;;
    leaderboard-course)  # D12 the course's way: compiled apply, do_bench(rep=10000, warmup=1000) mean, ours vs cuDNN (~1 min)
      python3 -m cs336_systems.cli.leaderboard --json "$OUT/leaderboard-course.json" 2>&1 | tail -3 ;;
    grade)  # $GRADE_REPOS (repositories or folders of them) graded side by side, one GPU each, course + leaderboard
      # tiers and rows (anchors: the suite's kernel and cuDNN per GPU model); COURSE_TESTS: a course release's tests/
      # too; GRADE_EXECUTOR=local: through submitit's local executor; GRADE_K: -k
      timeout "${GRADE_TIMEOUT:-540}" python3 -m cs336_systems.cli.grade ${GRADE_REPOS:-} --out "$OUT/class" \
        --tiers "${GRADE_TIERS:-course,leaderboard}" --bench --timeout 420 \
        ${GRADE_EXECUTOR:+--executor "$GRADE_EXECUTOR" --gpus-per-job 1} \
        ${COURSE_TESTS:+--course-tests "$COURSE_TESTS"} ${GRADE_K:+-- -k "$GRADE_K"} > "$OUT/class.log" 2>&1
      echo "grade rc=$?"; grep -v "cases done\|loading its code\| now: " "$OUT/class.log" | tail -30
      grep -H -E '"(parent_ms|forward|backward|ranked|unranked_because)"' "$OUT"/class/*/leaderboard.json
      tar czf "$OUT/class.tgz" -C "$OUT" class && rm -rf "$OUT/class" ;;  # one file: the device returns 8 a call
    walls)  # the walls on a GPU machine: every way out in a class; workers walled on CUDA; ncu observing inside them
      python3 -m pytest -p no:cacheprovider -q tests/contract/test_walls.py tests/contract/test_adversaries.py 2>&1 | tail -3 ;;
    leaderboard-fixtures)  # each leaderboard fixture's row and rank or reason; FIXTURES_K: -k (13 rows, ~60 s each on an H200)
      python3 -m pytest -p no:cacheprovider -q -s tests/contract/test_leaderboard_gpu.py ${FIXTURES_K:+-k "$FIXTURES_K"} 2>&1 \
        | grep -E "^adapters|passed|failed|Error" ;;
    sweep-d11)  # D11 (d 64, bf16, seq 1024, 16384) in one pytest process on GPU 0, then as sweep jobs, one per GPU; compared
      sel=(bench/bench_flash.py --only d=64 --only dtype=bf16 --only seq=1024,16384 -k 'test_flash_sweep and (flash_triton or sdpa_flash or sdpa_cudnn)')
      CUDA_VISIBLE_DEVICES=0 "${BENCH[@]}" "${sel[@]}" --benchmark-json="$OUT/d11-plain.json" 2>&1 | tail -2
      python3 -m cs336_systems.cli.sweep "${sel[@]}" --out "$OUT/d11-sweep" --executor local --gpus-per-job 1 --parallelism "$(nvidia-smi -L | wc -l)" --time-min 4 2>&1 | tail -2
      python3 -m cs336_systems.report --compare "$OUT/d11-plain.json" "$OUT/d11-sweep/sweep.json" | tee "$OUT/d11-compare.md" | head -1 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "=== done $(date +%T)"

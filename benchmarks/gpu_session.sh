#!/usr/bin/env bash
# One lease on a lent GPU machine: install Tessera into the machine's Python (which already has
# CUDA PyTorch and Triton), run the GPU tests, then the GPU benchmarks. Every step writes its
# log under $OUT (or ./gpu-out) and a failed step does not stop the later ones.
#
#   bash benchmarks/gpu_session.sh [STEP...]   steps: tests kernels host-profile train train1b
#                                              train1b-fp8 train1b-fp8-rowwise train1b-te fp8-convergence titan serve
#                                              serve1b serve-eager serve-profile (default: tests kernels train serve)
#
# Issue #19's training figures, llama-1b at seq 4096 (each step fits one 10-minute device call
# with the install; estimates for one H100, not measurements):
#   train1b              bf16: Tessera and transformers' LlamaForCausalLM, each alone on the GPU
#                        (--separate-processes): tokens/s, MFU against the bf16 peak, peak memory (~4 min)
#   train1b-fp8          the same in fp8, tensorwise (torchao Float8Linear in both frameworks) (~5 min)
#   train1b-fp8-rowwise  the same in fp8, rowwise (~5 min)
#   train1b-te           the same in fp8 through Transformer Engine (training.fp8_backend=te, tensorwise =
#                        Float8CurrentScaling; TE Linear in both frameworks, Tessera eager as TE requires);
#                        only where transformer_engine.pytorch imports: TE's CUDA wheels are far over the
#                        64 MiB carry and the machine has no network, so TE must be preinstalled in its
#                        Python; otherwise the step says why it skips (~5 min)
#   fp8-convergence      200 steps bf16 then fp8 (tensorwise) from the same init and data: final loss
#                        within 1% and fp8/bf16 tokens/s >= 1.3x (benchmarks/fp8_convergence.py) (~5 min)
#   titan                torchtitan's Llama 3 trainer, llama3 "1B", bf16 then float8 tensorwise
#                        (benchmarks/torchtitan_peer.py; needs its wheels in .whl/, see there) (~6 min)
#
# Python packages the machine's image lacks (pydantic 2 and pydantic-core, annotated-types,
# typing-inspection, typing-extensions, fastapi, starlette, uvicorn, opentelemetry-api, torchao
# for the FP8 tests and steps, and for `titan` torchtitan with the pure-Python packages it imports:
# benchmarks/torchtitan_peer.py lists them) travel as cp312 wheels in .whl/, fetched on a machine
# with a registry:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl pydantic==2.14.3 pydantic_core==2.50.4 ...
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
STEPS=${*:-tests kernels train serve}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET

step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, report the status
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "[gpu-session] $name: exit $rc in $((SECONDS - t0)) s"
    tail -n 25 "$OUT/$name.log"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$OUT/machine.txt"

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade .whl/*.whl || exit 1
fi
for pkg in packages/common kernels packages/data_prep packages/trainer packages/ckpt_convert packages/inference; do
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e "$pkg" || exit 1
done

for s in $STEPS; do
    case $s in
    tests)
        step tests 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests ;;
    kernels)  # RMSNorm, paged attention, then the fused kernels vs eager and vs inductor (compiles)
        step kernels 300 python3 benchmarks/kernels.py --dtype bf16 ;;
    host-profile)
        step host-profile 120 python3 benchmarks/kernels.py --host-profile ;;
    train)
        step train-160m 240 python3 benchmarks/train_throughput.py --device cuda --precision bf16 \
            --preset llama-160m --full-size --seq 2048 --batch 8 --steps 20 --warmup 5 \
            --json "$OUT/train-160m.json" ;;
    train1b | train1b-fp8 | train1b-fp8-rowwise)  # batch 2 x 4096: both frameworks' fp32 AdamW state fits 80 GB
        case $s in
        train1b) name=train-1b-bf16 precision=(--precision bf16) ;;
        train1b-fp8) name=train-1b-fp8-tensorwise precision=(--precision fp8 --fp8-recipe tensorwise) ;;
        *) name=train-1b-fp8-rowwise precision=(--precision fp8 --fp8-recipe rowwise) ;;
        esac
        step "$name" 500 python3 benchmarks/train_throughput.py --device cuda "${precision[@]}" \
            --preset llama-1b --full-size --seq 4096 --batch 2 --steps 10 --warmup 4 --separate-processes \
            --json "$OUT/$name.json" ;;
    train1b-te)
        if reason=$(python3 -c 'import transformer_engine.pytorch' 2>&1); then
            step train-1b-te-tensorwise 500 python3 benchmarks/train_throughput.py --device cuda --precision fp8 \
                --fp8-backend te --fp8-recipe tensorwise --no-compile --preset llama-1b --full-size --seq 4096 \
                --batch 2 --steps 10 --warmup 4 --separate-processes --json "$OUT/train-1b-te-tensorwise.json"
        else
            echo "[gpu-session] train1b-te: skipped: transformer_engine.pytorch does not import here" \
                "($(echo "$reason" | tail -n 1)); TE must be preinstalled on the GPU machine (no network there," \
                "and its CUDA wheels exceed the 64 MiB carry)"
        fi ;;
    fp8-convergence)
        step fp8-convergence 500 python3 benchmarks/fp8_convergence.py --device cuda --preset llama-1b \
            --seq 4096 --batch 2 --steps 200 --fp8-recipe tensorwise --json "$OUT/fp8-convergence.json" ;;
    titan)
        step torchtitan 500 python3 benchmarks/torchtitan_peer.py --steps 30 --warmup 10 \
            --json "$OUT/torchtitan.json" ;;
    serve | serve1b)  # issue #18: CUDA-graph decode (the default on CUDA) at 64 concurrent, TPOT next to the
        # weight-read floor; llama-1b is its own step so each fits one 10-minute device call
        if [ "$s" = serve ]; then
            step serve 300 python3 benchmarks/serving.py --device cuda --preset llama-160m \
                --num-requests 256 --concurrency 64 --naive-requests 16 --rounds 1 --max-num-batched-tokens 2048
        else
            step serve-1b 480 python3 benchmarks/serving.py --device cuda --preset llama-1b \
                --num-requests 128 --concurrency 64 --naive-requests 4 --rounds 1 --max-num-batched-tokens 2048
        fi
        grep -h -e "^model:" -e "physical floor" -e "TPOT median" "$OUT/${s/serve1b/serve-1b}.log" ;;
    serve-eager)  # the same llama-160m run without graphs, for the ratio
        step serve-eager 300 python3 benchmarks/serving.py --device cuda --preset llama-160m --enforce-eager \
            --num-requests 256 --concurrency 64 --naive-requests 16 --rounds 1 \
            --max-num-batched-tokens 2048 ;;
    serve-profile)  # host vs device time per decode step, eager and CUDA graphs
        step serve-profile 300 python3 benchmarks/serving_profile.py --device cuda --preset llama-160m \
            --concurrency 64 --num-requests 64 --decode-steps 64 ;;
    *) echo "gpu_session.sh: unknown step $s (steps: tests kernels host-profile train train1b train1b-fp8" \
            "train1b-fp8-rowwise train1b-te fp8-convergence titan serve serve1b serve-eager serve-profile)"; exit 2 ;;
    esac
done

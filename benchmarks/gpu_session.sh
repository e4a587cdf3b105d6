#!/usr/bin/env bash
# One GPU lease (15 minutes of device time, start included) in two device calls; the plan, its
# caps and the closing table are in gpu_session.py, which this runs with the machine's Python:
#   bash benchmarks/gpu_session.sh --dry-run     # on CPU: the plan, wheels present, caps <= 13 min
#   bash benchmarks/gpu_session.sh 1             # first call: install, gpu tests, llama-1b bf16 + fp8
#   bash benchmarks/gpu_session.sh 2             # second call (within 30 s): 8B-shaped fp8, decode
#   bash benchmarks/gpu_session.sh --step fp8-convergence     # a step outside the plan, by name
#   bash benchmarks/gpu_session.sh --step install titan-install titan  # the torchtitan peer: the newest
#                                  # carried release that imports here, then its run
exec python3 "$(dirname "$0")/gpu_session.py" "$@"

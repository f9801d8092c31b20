#!/usr/bin/env bash
# The whole train step timed on an NVIDIA GPU host (written for 1-8 x H200), from this checkout alone:
#
#   bench/gpu.sh [--steps 10] [--remat none]      # figures in $OUT (default out/gpu)
#
# Installs the pinned GPU package set (launch/install.sh gpu: JAX 0.10.2 with its CUDA 12 wheels; only the
# NVIDIA driver is needed on the host) into $VENV (default .venv-gpu), records nvidia-smi, then runs
# bench/gpu_step.py: a random-weight Qwen3-8B-shaped target and the design §11 drafter at T = 4096, 512
# anchors, B = 16, bf16, target attention on cuDNN. Writes gpu_step.json and gpu_step.md (step time, tokens/s,
# MFU against 989 TFLOP/s per H200, and the roofline step time the plan predicts for the same compiled step) to
# $OUT, then the targets' XLA attention by query chunk size
# (target_attention_chunks.md). Arguments go to bench/gpu_step.py.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/gpu}
export VENV=${VENV:-.venv-gpu}
mkdir -p "$out"
launch/install.sh gpu
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || echo "nvidia-smi not found" > "$out/nvidia-smi.txt"
# Let JAX take most of each GPU's memory (its default preallocation is 75%).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
"$VENV/bin/python" -m bench.gpu_step --out "$out" "$@" 2>&1 | tee "$out/gpu_step.log"
# The targets' XLA attention (cuDNN's fallback) by query chunk size: what QUERY_CHUNK_BY_PLATFORM["gpu"] is
# to be chosen from (ops/attention.py).
"$VENV/bin/python" -m bench.bench_target_attention_chunks --shapes B,qwen3_8b --rounds 3 2>&1 \
  | tee "$out/target_attention_chunks.md"

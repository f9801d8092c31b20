# Sourced by the launchers: the compiler and communication settings for long runs. Each is a default only: a
# variable the caller has set (even to an empty string, which turns the defaults off) is left as it is.

# TPU (read by libtpu): asynchronous collectives fused and overlapped with compute, the set MaxText's TPU
# recipes export (the FSDP all-gathers of the target's and the drafter's weights then run behind the matmuls).
tpu_performance_env() {
  export LIBTPU_INIT_ARGS="${LIBTPU_INIT_ARGS-\
--xla_tpu_enable_async_collective_fusion=true \
--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true \
--xla_tpu_enable_async_collective_fusion_multiple_steps=true \
--xla_tpu_overlap_compute_collective_tc=true \
--xla_enable_async_all_gather=true \
--xla_enable_async_collective_permute=true}"
}

# GPU: XLA's latency-hiding scheduler moves collectives so that they overlap compute (NVIDIA's JAX-Toolbox
# images set it), on a stream of the highest priority (JAX's GPU performance tips); NCCL reports its warnings, so
# a failing link or a fallback to a slow transport shows in the job's log.
gpu_performance_env() {
  export XLA_FLAGS="${XLA_FLAGS-\
--xla_gpu_enable_latency_hiding_scheduler=true \
--xla_gpu_enable_highest_priority_async_stream=true}"
  export NCCL_DEBUG="${NCCL_DEBUG-WARN}"
}

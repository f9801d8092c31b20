"""GPU plans (dflash_jax/planning/gpu_topology.py): the compiler's description of a GPU, GPU HLO read by hlo_cost,
the fallback to simulated CPU devices without the CUDA plugin, and (`make test-gpu-plan`, which installs the
plugin) a 27B-shaped step compiled by XLA's GPU compiler without a GPU."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from dflash_jax.models import layers
from dflash_jax.planning import plan as plan_module
from dflash_jax.planning.chips import chip_named
from dflash_jax.planning.gpu_topology import target_description
from dflash_jax.planning.hlo_cost import Collective, hlo_cost
from dflash_jax.planning.plan import plan_train_step, topology_devices
from dflash_jax.train import validate
from tests.planning_fixtures import qwen27b_layers


def test_the_compiler_is_told_the_chip_of_the_table():
    text = target_description(chip_named("H200"))
    assert "core_count: 132" in text and "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert "device_memory_size: 141000000000" in text and "memory_bandwidth: 4800000000000" in text
    assert text.endswith('device_description_str: "NVIDIA H200"\n')
    # The tensor cores' clock at which the table's 989 TFLOP/s is reached: 2048 bf16 multiply-adds an SM a clock.
    assert "clock_rate_ghz: 1.8292" in text


def test_without_the_cuda_plugin_a_gpu_cluster_is_planned_on_simulated_cpu_devices(monkeypatch, caplog):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with caplog.at_level(logging.WARNING):
        devices = topology_devices("gpu:H200x4x2")
    assert len(devices) == 8 and devices[0].platform == "cpu"
    assert "not importable: planning on 8 simulated XLA:CPU devices" in caplog.text
    assert "make .cudaplan/.installed" in caplog.text


# A matmul as XLA's GPU compiler writes it when it picks cuBLAS over Triton (shapes and attributes from its HLO:
# [512, 512] x [512, 1024] with a workspace in the result tuple), a Triton gemm fusion of the same product, and an
# asynchronous all-gather of 1 KiB over 8 devices.
GPU_HLO = """HloModule gpu, num_partitions=8

%gemm_fusion_dot_computation (parameter_0: bf16[512,512], parameter_1: bf16[512,1024]) -> bf16[512,1024] {
  %parameter_0 = bf16[512,512]{1,0} parameter(0)
  %parameter_1 = bf16[512,1024]{1,0} parameter(1)
  ROOT %dot.1 = bf16[512,1024]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[512,512], b: bf16[512,1024], v: bf16[64,8]) -> (bf16[512,1024], bf16[512,1024], bf16[512,8]) {
  %a = bf16[512,512]{1,0} parameter(0)
  %b = bf16[512,1024]{1,0} parameter(1)
  %v = bf16[64,8]{1,0} parameter(2)
  %custom-call.1 = (bf16[512,1024]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"operation_queue_id":"0","gemm_backend_config":{"selected_algorithm":"0","alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %get-tuple-element.2 = bf16[512,1024]{1,0} get-tuple-element(%custom-call.1), index=0
  %gemm_fusion_dot = bf16[512,1024]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %all-gather-start = (bf16[64,8]{1,0}, bf16[512,8]{1,0}) all-gather-start(%v), channel_id=1, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}, use_global_device_ids=true
  %all-gather-done = bf16[512,8]{1,0} all-gather-done(%all-gather-start)
  ROOT %out = (bf16[512,1024]{1,0}, bf16[512,1024]{1,0}, bf16[512,8]{1,0}) tuple(%get-tuple-element.2, %gemm_fusion_dot, %all-gather-done)
}
"""


def test_hlo_cost_reads_gpu_matmuls_and_asynchronous_collectives():
    cost = hlo_cost(GPU_HLO, {"fsdp": 8})
    assert cost.flops == 2 * (2 * 512 * 1024 * 512) and cost.custom_calls == 0  # cuBLAS's FLOPs are counted
    assert cost.collective_bytes == {Collective("all-gather", ("fsdp",), False): 7 * 64 * 8 * 2}
    # Each matmul reads its operands and writes its result (cuBLAS's workspace too); the all-gather reads 1 KiB
    # and writes 8, counted once at its start.
    operands, result = 2 * (512 * 512 + 512 * 1024), 2 * 512 * 1024
    assert cost.hbm_bytes == 2 * (operands + result) + 4194304 + 2 * (64 * 8 + 512 * 8)


def _cuda_plugin_or_skip():
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        pytest.skip("the CUDA plugin is not installed (make .cudaplan/.installed; `make test-gpu-plan` runs these "
                    "with it); deviceless GPU compiles need it")


@pytest.mark.gpu_plan
def test_deviceless_gpu_plan_of_a_27b_shaped_step_is_the_gpu_program(monkeypatch):
    """A 27B-shaped step (every 27B width, one period of 4 target layers, T = 1024, one row per GPU) on 2 hosts of
    8 H200, fsdp over a host's GPUs and data across the hosts, compiled by XLA's GPU compiler: GPU HLO (Triton gemm
    fusions, asynchronous NCCL collectives), no CPU-only custom backward traced, the bf16 weights not doubled by
    fp32 copies (as XLA:CPU's dots make them), the compiler's FLOPs the model's, and the gradient all-reduce the
    only traffic between hosts."""
    _cuda_plugin_or_skip()

    def cpu_only_backward(x, kernel):
        raise AssertionError("the CPU-only custom backward was traced for a GPU")

    monkeypatch.setattr(layers, "_dot_transposing_narrow_side", cpu_only_backward)
    texts = []
    monkeypatch.setattr(plan_module, "hlo_cost", lambda hlo, *args: texts.append(hlo) or hlo_cost(hlo, *args))
    config, target_config = qwen27b_layers(4)
    config.drafter.target_layer_ids, config.drafter.num_feature_layers = (0, 1, 2), 3
    config.data.seq_len, config.target_layout = 1024, "fsdp"
    config.mesh.update(data=1, fsdp=8, tensor=1, dcn_data=2)
    config.data.batch_size = 16
    plan = plan_train_step(config, target_config, validate.mesh_from_config(config, topology_devices("gpu:H200x8x2")))
    assert plan.backend == "gpu deviceless compiler, 16 x NVIDIA H200 (2 hosts of 8)"
    assert plan.roofline.chip.name == "H200" and plan.rows_per_device == 1 and plan.cost.unknown_loops == 0
    hlo = texts[0]
    assert "__triton_nested_gemm_fusion" in hlo and "all-gather-start" in hlo and "reduce-scatter-start" in hlo
    weights = {(target_config.hidden_size, target_config.vocab_size),
               (target_config.hidden_size, target_config.intermediate_size)}
    weights |= {shape[::-1] for shape in weights}
    assert not [a.text for a in plan.largest if a.dtype == "f32" and a.shape in weights], plan.largest
    # The GPU's buffers: the weights a device holds, its optimizer state and one row's activations with a
    # layer's gathered weights (measured 11.4 GiB; XLA:CPU's fp32 copies of the bf16 matmuls made it more).
    assert plan.total_bytes < 16 * 2**30, plan.total_bytes
    assert 0.7 < plan.cost.flops / (plan.model_flops / 16) < 1.5
    moved = plan.cost.collective_bytes
    assert moved[Collective("all-gather", ("fsdp",), False)] > plan.target_bytes * 7  # the fsdp layout's gathers
    remote = {key: size for key, size in moved.items() if key.remote}
    assert all(key.kind == "all-reduce" and "data" in key.axes for key in remote), remote
    assert remote[Collective("all-reduce", ("data",), True)] > 0.99 * sum(remote.values())  # the gradients
    assert plan.roofline.link_bytes["network"] > 0

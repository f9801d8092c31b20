"""What serves an export on TPUs, for the export's printout and its model card (docs/export_and_serving.md,
"Serving on TPUs", where `make test-vllm-tpu`'s findings are): vLLM TPU (tpu-inference 0.32) runs `dflash` exports
with the GPU's `vllm serve` line but without their windows and with another RoPE; SGLang-JAX runs them with one
optional window for every draft layer; no TPU server runs DSpark or DFlash2 drafters yet."""

from __future__ import annotations

import shlex

from dflash_jax.models.drafter import DrafterConfig
from dflash_jax.weights.drafter_files import SLIDING

WINDOW_COST = ("tpu-inference pull request #3528 measured 11% acceptance that way, against 48-50% once the "
               "windows were honoured")
ROPE = ("vLLM TPU 0.32 runs the drafter's RoPE as θ 1e6 with Llama-3 frequency scaling whatever config.json says "
        "(it reads rope keys that transformers 5 configs no longer keep), so its drafts differ from the trained "
        "ones")


def sglang_jax_command(target: str, drafter: str, config: DrafterConfig) -> str:
    """SGLang-JAX's server with the drafter (a linear chain of block_size tokens); with a window on each draft
    layer when the drafter has sliding layers."""
    window = f"SGL_JAX_DFLASH_DRAFT_PREFIX_WINDOW={config.sliding_window} " if SLIDING in config.layer_types else ""
    return (f"{window}python -m sgl_jax.launch_server --model-path {shlex.quote(target)} --speculative-algorithm "
            f"DFLASH --speculative-draft-model-path {shlex.quote(drafter)} --speculative-num-steps 1 "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {config.block_size}")


def tpu_note(config: DrafterConfig) -> str:
    """What the TPU servers make of this export, in sentences."""
    method = config.drafter_method
    if not method.tpu_served:
        return (f"No TPU server runs {method.title} drafters yet (vLLM TPU 0.32 and SGLang-JAX serve DFlash only): "
                f"serve it on GPUs.")
    if SLIDING not in config.layer_types:
        return f"vLLM TPU serves it with the same `vllm serve` line on a TPU host, and SGLang-JAX too. {ROPE}."
    refused = ("refuses this drafter, which mixes sliding and full layers (its V1 model runner has no such DFlash "
               "drafts, its V2 runner needs Triton on a GPU), and would run its sliding layers as full attention"
               if len(set(config.layer_types)) > 1 else "runs its sliding layers as full attention")
    return (f"vLLM TPU 0.32 ignores layer_types and sliding_window: it {refused} ({WINDOW_COST}). On TPUs, SGLang-JAX "
            f"honours a window of {config.sliding_window} tokens, on every draft layer (the full ones too); a GPU "
            f"engine (the vLLM line above, or SGLang) serves the layers as trained.")


def tpu_commands(target: str, drafter: str, config: DrafterConfig, vllm_line: str) -> list[str]:
    """The commands that serve this export on TPUs: vLLM TPU's (the GPU line) where it runs the drafter as
    trained but for its RoPE, SGLang-JAX's for every `dflash` export."""
    if not config.drafter_method.tpu_served:
        return []
    vllm = [vllm_line] if SLIDING not in config.layer_types else []
    return vllm + [sglang_jax_command(target, drafter, config)]

"""Step 2 of `make test-vllm-tpu` (vLLM TPU venv, CPU): vLLM TPU (tpu-inference) reads and runs the exports of
make_artifacts.py as trained.

For each drafter of OUT/artifacts.json:
  1. config: vLLM's engine config with `speculative_config={"method": "dflash", ...}`, as `vllm serve` builds it
     on a TPU host; tpu-inference's JAX DFlashForCausalLM must read the trained block size, mask token, feature
     layers (its fc width, and the layers its Qwen3 target captures) and layer count;
  2. weights: its weight loader must place every tensor of the export and leave no parameter unloaded but the
     embedding and LM head, which its proposer takes from the target;
  3. logits: its model, in fp32 on the project's context features and block, with the target's embedding and LM
     head, must give the project's draft logits (make_artifacts.py), once its RoPE is the trained one (it reads
     another: same_logits). Its ragged paged attention kernel needs a TPU; on CPU it runs tpu-inference's
     reference implementation of that kernel instead. The sliding drafter must match the project's drafter with
     every layer full attention, and not the one with its window: vLLM TPU 0.32 ignores layer_types and
     sliding_window. The mixed drafter must be refused, as vLLM TPU 0.32 refuses it.
No TPU here, so vLLM's platform is set to vLLM TPU's by hand (it is chosen by finding libtpu).
Run: .venv-vllm-tpu/bin/python tests/serving_tpu/check_vllm_tpu.py OUT
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# tpu-inference logs the TPU it runs on at import, asking the cloud's metadata server unless told: say "none".
for variable, value in (("TPU_ACCELERATOR_TYPE", "none"), ("TPU_NAME", "none"), ("TPU_WORKER_ID", "0")):
    os.environ.setdefault(variable, value)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

LOGIT_TOLERANCE = 1e-4  # max |Δ| relative to the largest |logit|: both sides fp32 on the same bf16 weights
PAGE_SIZE = 16
KNOWN_ROPE_THETA = 1e6  # what its DFlash model falls back to (same_logits)
MIXED_REFUSAL = "Model Runner V1 does not support: mixed sliding/full dflash drafts"
SHARED = {"model.embed_tokens.embedding", "lm_head.weight"}  # the proposer shares the target's


def use_tpu_platform() -> None:
    """vLLM TPU's platform, before anything of vLLM's reads which platform it runs on."""
    import vllm.platforms
    from tpu_inference.platforms.tpu_platform import TpuPlatform
    vllm.platforms.current_platform = TpuPlatform()


def engine_config(target: str, drafter: str, draft_tokens: int):
    from vllm.engine.arg_utils import EngineArgs
    return EngineArgs(model=target, dtype="float32", max_model_len=512, skip_tokenizer_init=True,
                      speculative_config={"method": "dflash", "model": drafter,
                                          "num_speculative_tokens": draft_tokens}).create_engine_config()


def load_recording(vllm_config):
    """tpu-inference's draft model as its model loader builds and loads it; (model, names of the export's
    tensors the loader read, parameter paths it wrote)."""
    from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES
    from tpu_inference.models.common import model_loader
    from tpu_inference.models.jax.utils import weight_utils
    from tpu_inference.utils import to_jax_dtype
    read, written = set(), set()
    load, find = weight_utils._load_and_shard_weight, weight_utils.get_param_and_sharding

    def recording_load(vllm_config, params, shardings, metadata_map, mesh, hf_key, *args, **kwargs):
        read.add(hf_key)
        return load(vllm_config, params, shardings, metadata_map, mesh, hf_key, *args, **kwargs)

    def recording_find(params, shardings, path):
        written.add(path)
        return find(params, shardings, path)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(MESH_AXIS_NAMES)), MESH_AXIS_NAMES)
    vllm_config.model_config.dtype = to_jax_dtype(vllm_config.model_config.dtype)  # as get_flax_model does
    model_class = model_loader._get_model_architecture(vllm_config.speculative_config.draft_model_config.hf_config)
    weight_utils._load_and_shard_weight, weight_utils.get_param_and_sharding = recording_load, recording_find
    try:
        with jax.set_mesh(mesh):
            model = model_loader._get_nnx_model(model_class, vllm_config, jax.random.key(0), mesh,
                                                is_draft_model=True)
    finally:
        weight_utils._load_and_shard_weight, weight_utils.get_param_and_sharding = load, find
    return model, read, written


def reference_attention(kv_cache, q, k, v, attention_metadata, mesh, head_dim_original=None, sm_scale=None,
                        use_causal_mask=True, **_):
    """tpu-inference's `attention` with its kernel's own reference implementation (one device, no sharding)."""
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import ref_ragged_paged_attention
    md = attention_metadata
    out, kv_cache = ref_ragged_paged_attention(q, k, v, kv_cache, md.seq_lens, md.block_tables, md.query_start_loc,
                                               md.request_distribution, use_causal_mask=use_causal_mask,
                                               sm_scale=sm_scale)
    return kv_cache, out


def draft_logits(model, features: np.ndarray, block_ids: np.ndarray, embedding: np.ndarray) -> np.ndarray:
    """The model's logits of the drafted slots for one request: the context's features written into its paged
    cache, then the block at the position after the context, as its DFlash proposer runs a step."""
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import get_kv_cache_shape
    from tpu_inference.layers.common.attention_metadata import AttentionMetadata
    from tpu_inference.models.jax import dflash
    context, block = len(features), len(block_ids)
    model.model.embed_tokens.embedding.set_value(jnp.asarray(embedding))
    model.lm_head.weight.set_value(jnp.asarray(embedding).T)  # the toy target ties its LM head to the embedding
    attention = model.model.layers[0].self_attn
    pages = math.ceil((context + block) / PAGE_SIZE)
    shape = get_kv_cache_shape(pages, PAGE_SIZE, attention.num_kv_heads, attention.head_dim, jnp.float32)
    kv_caches = [jnp.zeros(shape, jnp.float32) for _ in model.model.layers]
    metadata = AttentionMetadata(input_positions=jnp.arange(context, context + block, dtype=jnp.int32),
                                 block_tables=jnp.arange(pages, dtype=jnp.int32),
                                 seq_lens=jnp.array([context], jnp.int32),
                                 query_start_loc=jnp.array([0, block], jnp.int32),
                                 request_distribution=jnp.array([0, 0, 1], jnp.int32))
    target_hidden = model.combine_hidden_states(jnp.asarray(features))
    original, dflash.attention = dflash.attention, reference_attention
    try:
        _, hidden, _, _ = model(kv_caches, jnp.asarray(block_ids, jnp.int32),
                                (target_hidden, jnp.array([0, context], jnp.int32),
                                 jnp.arange(context, dtype=jnp.int32)), metadata)
    finally:
        dflash.attention = original
    return np.asarray(model.compute_logits(hidden[1:]))


def target_embedding(target: str) -> np.ndarray:
    from safetensors.numpy import load_file
    tensors = {}
    for path in Path(target).glob("*.safetensors"):
        tensors.update(load_file(path))
    return tensors["model.embed_tokens.weight"].astype(np.float32)


def read_as_trained(name: str, model, vllm_config, trained: dict) -> list[str]:
    """Step 1's failures: what tpu-inference's model and its Qwen3 target read from the export."""
    from tpu_inference.models.jax.qwen3 import Qwen3Model
    seen = {"block size": model.block_size, "mask token": model.mask_token_id, "layers": len(model.model.layers),
            "fc features": model.model.fc.kernel.shape[0] // model.hf_config.hidden_size,
            "target feature layers": Qwen3Model.get_dflash_aux_hidden_state_layers(None, vllm_config)}
    want = {"block size": trained["block_size"], "mask token": trained["mask_token_id"],
            "layers": trained["num_hidden_layers"], "fc features": len(trained["target_layer_ids"]),
            "target feature layers": trained["target_layer_ids"]}
    print(f"vLLM TPU {name}: read {seen}", flush=True)
    return [f"{name}: {key} {seen[key]} != trained {want[key]}" for key in want if seen[key] != want[key]]


def loaded_completely(name: str, model, directory: str, read: set, written: set) -> list[str]:
    """Step 2's failures."""
    from safetensors import safe_open
    with safe_open(Path(directory) / "model.safetensors", "np") as f:
        tensors = set(f.keys())
    params = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    unread, unloaded = sorted(tensors - read), sorted(params - written - SHARED)
    print(f"vLLM TPU {name}: {len(read)} of the export's {len(tensors)} tensors loaded into {len(written)} "
          f"parameters; not loaded: {sorted(params - written)} (shared from the target)", flush=True)
    if unread or unloaded or len(written) != len(tensors):
        return [f"{name}: tensors not read {unread}, parameters not loaded {unloaded}"]
    return []


def set_rope(model, theta: float, scaling: dict | None) -> tuple[float, dict | None]:
    """Give every layer this RoPE; returns the one the model had."""
    before = model.model.layers[0].self_attn.rope_theta, model.model.layers[0].self_attn.rope_scaling
    for layer in model.model.layers:
        layer.self_attn.rope_theta, layer.self_attn.rope_scaling = theta, scaling
    return before


def same_logits(name: str, model, reference, embedding: np.ndarray, trained: dict) -> list[str]:
    """Step 3's failures. vLLM TPU 0.32's DFlash model reads `rope_theta` / `rope_scaling` attributes that
    transformers 5 configs no longer have (they moved to rope_parameters, which the rope_scaling alias returns):
    it runs θ 1e6 with its Llama-3 frequency scaling whatever the export says. The logits are compared with the
    trained RoPE put back, so that they show whether everything else matches; what the read RoPE costs is
    reported (drafted tokens equal to the project's)."""
    def relative(a, b):
        return np.abs(a - b).max() / np.abs(b).max()

    read = set_rope(model, trained["rope_theta"], trained["rope_scaling"])
    logits = draft_logits(model, reference["features"], reference["block_ids"], embedding)
    set_rope(model, *read)
    as_read = draft_logits(model, reference["features"], reference["block_ids"], embedding)
    equal = int((as_read.argmax(-1) == reference["logits"].argmax(-1)).sum())
    print(f"vLLM TPU {name}: RoPE read as θ {read[0]:g}, scaling {read[1]} (trained θ {trained['rope_theta']:g}, "
          f"scaling {trained['rope_scaling']}); with it, drafted tokens equal to the project's {equal}/{len(logits)}, "
          f"relative max |Δ logit| {relative(as_read, reference['logits']):.1e}", flush=True)
    failures = [] if read[0] == KNOWN_ROPE_THETA and read[1] else [
        f"{name}: vLLM TPU no longer reads RoPE as θ 1e6 with Llama-3 scaling: update weights/tpu_serving.py"]
    as_trained = relative(logits, reference["logits"])
    if "logits_all_full" not in reference:
        print(f"vLLM TPU {name}: with the trained RoPE, relative max |Δ logit| {as_trained:.1e} against the "
              f"project's", flush=True)
        return failures + ([f"{name}: logits differ from the project's"] if as_trained > LOGIT_TOLERANCE else [])
    as_full = relative(logits, reference["logits_all_full"])
    print(f"vLLM TPU {name}: with the trained RoPE, relative max |Δ logit| {as_full:.1e} against the project's "
          f"drafter with every layer full attention, {as_trained:.1e} against it with its window", flush=True)
    if as_full > LOGIT_TOLERANCE or as_trained < 100 * LOGIT_TOLERANCE:
        failures.append(f"{name}: the logits do not show sliding layers run as full attention")
    return failures


def check(name: str, drafter: dict, artifacts: dict, embedding: np.ndarray) -> list[str]:
    """The failures of steps 1-3 for one drafter; for one that mixes sliding and full layers, that vLLM TPU
    0.32 refuses it (its V1 model runner has no mixed DFlash drafts and its V2 one needs a Triton GPU driver)."""
    trained = drafter["trained"]
    try:
        vllm_config = engine_config(artifacts["target"], drafter["dir"], trained["block_size"] - 1)
    except Exception as error:  # vLLM raises a pydantic ValidationError while building its config
        if len(set(trained["layer_types"])) > 1 and MIXED_REFUSAL in str(error):
            print(f"vLLM TPU {name}: refused, as known: {MIXED_REFUSAL}", flush=True)
            return []
        raise
    if len(set(trained["layer_types"])) > 1:
        return [f"{name}: vLLM TPU accepted a drafter that mixes sliding and full layers: update the export's "
                f"TPU note and this check"]
    model, read, written = load_recording(vllm_config)
    return (read_as_trained(name, model, vllm_config, trained)
            + loaded_completely(name, model, drafter["dir"], read, written)
            + same_logits(name, model, np.load(drafter["reference"]), embedding, trained))


def main(out_dir: str) -> None:
    use_tpu_platform()
    artifacts = json.loads((Path(out_dir) / "artifacts.json").read_text())
    embedding = target_embedding(artifacts["target"])
    failures = [failure for name, drafter in artifacts["drafters"].items()
                for failure in check(name, drafter, artifacts, embedding)]
    count = len(artifacts["drafters"])
    failed = len({failure.split(":")[0] for failure in failures})
    print(f"vLLM TPU drafter checks: {count - failed} passed, {failed} failed")
    if failures:
        sys.exit("\n".join(failures))


if __name__ == "__main__":
    main(sys.argv[1])

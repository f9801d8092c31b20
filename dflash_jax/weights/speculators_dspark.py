"""The speculators-format config.json and tensor names of a DSpark drafter export (design §18.1).

vLLM serves `method: "dspark"` from a speculators directory: its config loader (vLLM's
`transformers_utils.configs.speculators`: `base.SpeculatorsConfig` and `algos.update_dspark`) builds the draft's
Qwen3 config from `transformer_layer_config`, maps `aux_hidden_state_layer_ids` (HF hidden-state indexing, one
above our target_layer_ids) to the target layers, copies `mask_token_id`, `markov_rank`, `block_size`,
`enable_confidence_head`, `confidence_head_with_markov`, `draft_vocab_size` and `sample_from_anchor`, and takes
the number of speculative tokens from `speculators_config.proposal_methods[0]`. Its model
(`model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM`) loads the DFlash backbone names of design §10
plus `markov_head.markov_w1.weight` [V, r] (an embedding), `markov_head.markov_w2.weight` [V, r] (a Linear
r → V) and `confidence_head.proj.{weight [1, H + r], bias [1]}`. The key set follows speculators' DSpark
`save_pretrained` (its `models.dspark` config). These functions work on the z-lab dict of
weights/drafter_files.py, so that one Qwen3 description serves both layouts.
"""

from __future__ import annotations

from pathlib import Path

from dflash_jax.runtime.errors import CheckpointError

MODEL_TYPE = "dspark"
# Our Markov head is speculators' "vanilla" one, the only variant vLLM's model has weights for.
MARKOV_HEAD_TYPE = "vanilla"
# NNX path of each head parameter -> (export name, whether it is a Linear kernel stored transposed).
HEAD_TENSORS = {("markov_head", "w1"): ("markov_head.markov_w1.weight", False),
                ("markov_head", "w2"): ("markov_head.markov_w2.weight", True),
                ("confidence_head", "kernel"): ("confidence_head.proj.weight", True),
                ("confidence_head", "bias"): ("confidence_head.proj.bias", False)}
# z-lab keys that are not part of the Qwen3 layer config (they become the DSpark keys below).
_ZLAB_ONLY = ("architectures", "block_size", "num_target_layers", "dflash_config", "dtype")


def is_dspark(raw: dict) -> bool:
    return raw.get("speculators_model_type") == MODEL_TYPE


def dspark_config(zlab: dict, markov_rank: int, target: str | None) -> dict:
    """The speculators DSpark config.json from the drafter's z-lab config dict (`zlab_config`).

    Every slot of our DSpark blocks predicts the next token (design §18), so `sample_from_anchor` is true and
    vLLM proposes block_size tokens per step. The causality of each layer follows layer_types in vLLM (no
    `sliding_window_non_causal` is passed on), as trained. `num_target_layers` is ours, read back on load.
    """
    dflash, block_size = zlab["dflash_config"], zlab["block_size"]
    return {
        "architectures": ["DSparkDraftModel"],
        "speculators_model_type": MODEL_TYPE,
        "aux_hidden_state_layer_ids": [i + 1 for i in dflash["target_layer_ids"]],
        "block_size": block_size,
        "draft_vocab_size": zlab["vocab_size"],
        "mask_token_id": dflash["mask_token_id"],
        "sample_from_anchor": True,
        "sliding_window_non_causal": False,
        "target_hidden_size": None,
        "markov_rank": markov_rank,
        "markov_head_type": MARKOV_HEAD_TYPE,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "tie_word_embeddings": False,
        "num_target_layers": zlab["num_target_layers"],
        "dtype": zlab["dtype"],
        "speculators_config": {
            "algorithm": MODEL_TYPE, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block_size,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": target, "architectures": []}},
        "transformer_layer_config": {key: value for key, value in zlab.items() if key not in _ZLAB_ONLY},
    }


def zlab_view(raw: dict, where: Path) -> tuple[dict, int]:
    """(the z-lab config dict, markov_rank) of a speculators DSpark config.json; CheckpointError for one this
    drafter cannot reproduce (another Markov head, no confidence head, a reduced vocabulary, DFlash's blocks)."""
    layer = raw.get("transformer_layer_config")
    missing = [key for key in ("aux_hidden_state_layer_ids", "block_size", "mask_token_id", "markov_rank",
                               "num_target_layers") if raw.get(key) is None]
    if not isinstance(layer, dict) or missing:
        raise CheckpointError(f"{where}: a DSpark config needs transformer_layer_config and "
                              f"{', '.join(missing) or 'the DSpark keys'}")
    expected = {"markov_head_type": MARKOV_HEAD_TYPE, "enable_confidence_head": True,
                "confidence_head_with_markov": True, "sample_from_anchor": True,
                "draft_vocab_size": layer.get("vocab_size")}
    wrong = [f"{key}={raw.get(key)!r} (expected {value!r})" for key, value in expected.items()
             if raw.get(key, value) != value]
    if wrong:
        raise CheckpointError(f"{where}: unsupported DSpark settings: {', '.join(wrong)}")
    zlab = {**layer, "block_size": raw["block_size"], "num_target_layers": raw["num_target_layers"],
            "dflash_config": {"mask_token_id": raw["mask_token_id"],
                              "target_layer_ids": [i - 1 for i in raw["aux_hidden_state_layer_ids"]]}}
    return zlab, raw["markov_rank"]

"""The config.json keys and tensor names of a DFlash2 drafter export (design §18.5).

A DFlash2 drafter is written in the z-lab layout of design §10 (weights/drafter_files.py) with
`architectures: ["DFlash2DraftModel"]` and four more `dflash_config` keys, `conv_kernel_size`,
`conv_group_size`, `selector_rank` and `selector_top_k`: the config vLLM 0.32 maps to its
`DFlash2Qwen3ForCausalLM` (model_executor/models/qwen3_dflash2.py, which reads the four keys with `int(...)`)
and serves with `method: "dflash"` (the candidate selector is chosen by the architecture) on its V2 model runner,
with one convolution block of 1 + num_speculative_tokens = block_size queries. The tensors are the DFlash
backbone's plus, per layer i and sublayer s in (attention_conv, mlp_conv), `layers.{i}.{s}.base_kernel [2, K, H]`
and `layers.{i}.{s}.kernel_projection.weight [2·K·G, H]`, and `candidate_selector.predecessor_codebook [V, r]`,
`candidate_selector.successor_codebook [V, r]`, `candidate_selector.hidden_projection.weight [r, H]`: the names
of vLLM's model and of vLLM speculators' `DFlash2DraftModel`.
"""

from __future__ import annotations

from pathlib import Path

from dflash_jax.runtime.errors import CheckpointError

ARCHITECTURE = "DFlash2DraftModel"
FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Parameters exported under their own name, without the ".weight" of a module's weight.
BARE_PARAMETERS = ("base_kernel", "predecessor_codebook", "successor_codebook")


def is_dflash2(raw: dict) -> bool:
    return ARCHITECTURE in (raw.get("architectures") or ())


def dflash2_config(zlab: dict, config) -> dict:
    """The config.json of a DFlash2 drafter (DrafterConfig `config`) from its z-lab dict (`zlab_config`)."""
    return {**zlab, "architectures": [ARCHITECTURE],
            "dflash_config": {**zlab["dflash_config"], **{field: getattr(config, field) for field in FIELDS}}}


def dflash2_fields(raw: dict, where: Path | str) -> dict[str, int]:
    """The DrafterConfig fields of a DFlash2 config.json's dflash_config; CheckpointError naming the file when
    one is missing or not a positive int (vLLM reads each with int())."""
    dflash = raw.get("dflash_config") or {}
    fields = {field: dflash.get(field) for field in FIELDS}
    wrong = [f"{field}={value!r}" for field, value in fields.items()
             if not isinstance(value, int) or isinstance(value, bool) or value < 1]
    if wrong:
        raise CheckpointError(f"{where}: a {ARCHITECTURE} config needs positive ints dflash_config."
                              f"{{{', '.join(FIELDS)}}}; got {', '.join(wrong)}")
    return fields

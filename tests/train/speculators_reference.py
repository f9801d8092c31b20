"""vLLM speculators 0.9.0's PyTorch DSpark and DFlash models and losses on given weights and inputs (fp32, CPU,
eager attention and losses): the reference side of tests/train/test_speculators_parity.py.

Runs in `.venv-speculators` (`make venv-speculators`) and imports nothing of this project:

    .venv-speculators/bin/python tests/train/speculators_reference.py DIR

DIR/cases.json holds the drafter's shape and the cases; DIR/arrays.npz each method's drafter weights under their
export names (PyTorch [out, in]; `weight/<method>/<name>`), the target's embedding and LM head [V, H], and per
case one packed row (`<case>/<input>`): the feature layers, input ids, loss mask, the target's final-normed last
hidden states, document and position ids, and the anchors (speculators draws random ones; here `select_anchors`
returns these, all valid). For each case (a model, its loss spec, position weighting and confidence weight) it
runs the model's forward and backward and writes
DIR/out.npz: `<case>/loss`, `<case>/metric/<name>` (the forward's metrics: the per-term values among them),
`<case>/logits` (the drafter's logits as the loss sees them, Markov-corrected for DSpark), `<case>/confidence`
(DSpark's confidence logits) and `<case>/grad/<name>` for every trained weight.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.dflash import core as dflash_core
from speculators.models.dspark import core as dspark_core
from speculators.models.dspark.config import DSparkSpeculatorConfig
from speculators.models.dspark.core import DSparkDraftModel
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config

FROZEN = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight")


def build(shape: dict, method: str, arrays: dict[str, np.ndarray]):
    layers = Qwen3Config(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"], rms_norm_eps=shape["rms_norm_eps"],
        max_position_embeddings=shape["max_position_embeddings"], layer_types=shape["layer_types"],
        # Qwen3Config drops sliding_window (and speculators then runs every layer as full attention) unless
        # use_sliding_window is set.
        sliding_window=shape["sliding_window"], use_sliding_window="sliding_attention" in shape["layer_types"],
        rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]})
    layers._attn_implementation = "eager"
    dspark = method == "dspark"
    block = shape["block_size"]
    common = dict(
        transformer_layer_config=layers, draft_vocab_size=shape["vocab_size"], block_size=block,
        aux_hidden_state_layer_ids=[i + 1 for i in shape["target_layer_ids"]], mask_token_id=shape["mask_token_id"],
        sample_from_anchor=dspark,
        speculators_config=SpeculatorsConfig(
            algorithm=method, default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block if dspark else block - 1)],
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"])))
    if dspark:
        model = DSparkDraftModel(DSparkSpeculatorConfig(
            **common, markov_rank=shape["markov_rank"], markov_head_type="vanilla", enable_confidence_head=True,
            confidence_head_with_markov=True))
    else:
        model = DFlashDraftModel(DFlashSpeculatorConfig(**common))
    model.verifier_norm = torch.nn.Identity()  # the hidden states given are the target's final-normed ones
    prefix = f"weight/{method}/"
    weights = {name[len(prefix):]: torch.from_numpy(value) for name, value in arrays.items()
               if name.startswith(prefix)}
    weights.update({"embed_tokens.weight": torch.from_numpy(arrays["embed"]),
                    "lm_head.weight": torch.from_numpy(arrays["lm_head"]),
                    "verifier_lm_head.weight": torch.from_numpy(arrays["lm_head"])})
    missing, unexpected = model.load_state_dict(weights, strict=False)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    given = set(weights) - set(FROZEN)
    if unexpected or trained != given:
        raise SystemExit(f"error: weight names differ: unexpected {unexpected}, missing {sorted(trained - given)}, "
                         f"extra {sorted(given - trained)}")
    return model.float()


def main(directory: str) -> None:
    directory = Path(directory)
    spec = json.loads((directory / "cases.json").read_text())
    arrays = dict(np.load(directory / "arrays.npz"))
    chosen, seen, out = {}, {}, {}
    dflash_core.select_anchors = lambda loss_mask, num_anchors, block_size: (
        chosen["anchors"], torch.ones(num_anchors, dtype=torch.bool))
    for case in spec["cases"]:
        name, method = case["name"], case["method"]
        inputs = {key: torch.from_numpy(arrays[f"{name}/{key}"]) for key in
                  ("hidden_states", "input_ids", "loss_mask", "verifier_last_hidden_states", "document_ids",
                   "position_ids")}
        chosen["anchors"] = torch.from_numpy(arrays[f"{name}/anchors"])
        module = dspark_core if method == "dspark" else dflash_core
        original = module.compute_metrics

        def capture(logits, targets, *args, **kwargs):
            seen["logits"] = logits.detach().clone()
            if method == "dspark":
                seen["confidence"] = args[0].detach().clone()
            return original(logits, targets, *args, **kwargs)

        module.compute_metrics = capture
        model = build(spec["shape"], method, arrays)
        extra = ({"confidence_head_alpha": case["confidence_alpha"],
                  "tv_loss_fn": resolve_loss_config("tv", "eager")["tv"][0]} if method == "dspark" else {})
        _, loss, metrics = model(**inputs, loss_config=resolve_loss_config(json.dumps(case["loss"]), "eager"),
                                 gamma=spec["gamma"], max_anchors=len(chosen["anchors"]),
                                 per_position_loss_weight=case["position_weights"],
                                 dpace_alpha=spec["dpace_alpha"], **extra)
        loss.backward()
        module.compute_metrics = original
        out[f"{name}/loss"] = loss.detach().numpy()
        out.update({f"{name}/metric/{key}": value.detach().float().numpy() for key, value in metrics.items()})
        out.update({f"{name}/{key}": value.numpy() for key, value in seen.items()})
        out.update({f"{name}/grad/{key}": p.grad.numpy() for key, p in model.named_parameters() if p.requires_grad})
        seen.clear()
    np.savez(directory / "out.npz", **out)


if __name__ == "__main__":
    main(sys.argv[1])

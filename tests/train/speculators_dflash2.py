"""vLLM speculators 0.9.0's DFlash2 drafter and losses on the inputs and weights of the project's DFlash2 step,
for tests/train/test_dflash2_parity.py. Runs in `.venv-speculators` (`make venv-speculators`) and imports
nothing of this project:

    .venv-speculators/bin/python tests/train/speculators_dflash2.py IN.npz OUT.npz

IN.npz (written by the test): `shape` (the drafter's config as JSON), `cases` (JSON: name -> loss spec,
position weighting, selector alpha), the inputs of one packed row (`hidden_states`, `input_ids`, `loss_mask`,
`verifier_last_hidden_states`, `document_ids`, `position_ids`), the `anchors`, the target's `vocabulary` matrix
(its tied embedding and LM head) and every trained weight as `weight/<speculators name>`. The verifier hidden
states are the project target's final-normed ones, so the model's `verifier_norm` is the identity here; the
anchors are the project's grid (speculators would draw random ones); attention and losses are eager (CPU).

OUT.npz: the unary `logits` [rows, V] of every block slot, the selector's training `candidate_ids` and their
`candidate_scores` [rows, K] (the forward's `_backbone_forward` and `candidate_selector`, as its `forward` calls
them), and per case `<case>/loss`, `<case>/unary_loss`, `<case>/selector_loss` and `<case>/grad/<name>` of every
trained weight, from `DFlash2DraftModel.forward` and its backward.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.dflash import core as dflash_core
from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
from speculators.models.dflash2.metrics import selector_training_candidates
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config

INPUTS = ("hidden_states", "input_ids", "loss_mask", "verifier_last_hidden_states", "document_ids", "position_ids")


def build(shape: dict, weights: dict[str, np.ndarray], vocabulary: np.ndarray) -> DFlash2DraftModel:
    layers = Qwen3Config(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"], rms_norm_eps=shape["rms_norm_eps"],
        max_position_embeddings=shape["max_position_embeddings"], layer_types=list(shape["layer_types"]),
        rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]})
    layers._attn_implementation = "eager"
    block = shape["block_size"]
    config = DFlash2SpeculatorConfig(
        transformer_layer_config=layers, draft_vocab_size=shape["vocab_size"], block_size=block,
        aux_hidden_state_layer_ids=[i + 1 for i in shape["target_layer_ids"]], mask_token_id=shape["mask_token_id"],
        conv_kernel_size=shape["conv_kernel_size"], conv_group_size=shape["conv_group_size"],
        selector_rank=shape["selector_rank"], selector_top_k=shape["selector_top_k"],
        speculators_config=SpeculatorsConfig(
            algorithm="dflash2", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"])))
    model = DFlash2DraftModel(config)
    model.verifier_norm = torch.nn.Identity()  # the hidden states given are already final-normed
    matrix = torch.nn.Parameter(torch.from_numpy(vocabulary), requires_grad=False)
    model.embed_tokens.weight = model.lm_head.weight = model.verifier_lm_head.weight = matrix
    _, unexpected = model.load_state_dict({name: torch.from_numpy(w) for name, w in weights.items()}, strict=False)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    if unexpected or trained != set(weights):
        raise SystemExit(f"error: weight names differ: unexpected {unexpected}, missing "
                         f"{sorted(trained - set(weights))}, extra {sorted(set(weights) - trained)}")
    return model.float().train()


def main(inputs_file: str, out_file: str) -> None:
    data = np.load(inputs_file)
    shape, cases = json.loads(str(data["shape"])), json.loads(str(data["cases"]))
    weights = {key.removeprefix("weight/"): data[key] for key in data.files if key.startswith("weight/")}
    model = build(shape, weights, data["vocabulary"])
    inputs = {name: torch.from_numpy(data[name]) for name in INPUTS}
    anchors = torch.from_numpy(data["anchors"])
    # The project's grid instead of speculators' random draw; which slots train is the loss mask's business.
    dflash_core.select_anchors = lambda loss_mask, count, block_size: (anchors, torch.ones(count, dtype=torch.bool))

    out = {}
    with torch.no_grad():
        hidden, logits, targets, _, block_indices = model._backbone_forward(**inputs, max_anchors=len(anchors))
        predecessors = model._predecessor_ids(inputs["input_ids"], block_indices).reshape(1, -1)
        candidates = logits.topk(model.candidate_selector.top_k, dim=-1).indices
        candidate_ids, _, _ = selector_training_candidates(candidates, targets.argmax(dim=-1))
        scores = model.candidate_selector.score_candidates(logits, hidden, predecessors, candidate_ids)
    out.update(logits=logits[0].numpy(), candidate_ids=candidate_ids[0].numpy(), candidate_scores=scores[0].numpy())

    for name, case in cases.items():
        kwargs, _ = DFlash2DraftModel.get_trainer_kwargs(
            loss_fn=case["loss_fn"], loss_implementation="eager", max_anchors=len(anchors),
            dflash_decay_gamma=case["gamma"], per_position_loss_weight=case["position_weights"],
            dpace_alpha=case["dpace_alpha"], selector_loss_alpha=case["selector_alpha"])
        model.zero_grad()
        _, loss, metrics = model(**inputs, **kwargs)
        loss.backward()
        out[f"{name}/loss"] = loss.detach().numpy()
        out[f"{name}/unary_loss"] = metrics["unary_loss_sum"].numpy()
        out[f"{name}/selector_loss"] = metrics["selector_loss_sum"].numpy()
        for weight_name, parameter in model.named_parameters():
            if parameter.requires_grad:
                out[f"{name}/grad/{weight_name}"] = parameter.grad.numpy().copy()
    np.savez(out_file, **out)


if __name__ == "__main__":
    main(*sys.argv[1:])

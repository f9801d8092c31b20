"""The speculators side of `bench/peer_step.py`: vLLM's PyTorch DFlash trainer step, timed on request.

Runs in `.venv-speculators` (`make venv-speculators`). Started with two arguments, the shape as JSON and an
.npz of the inputs both sides get (both written by `bench/peer_step.py`), it builds speculators'
`DFlashDraftModel` with sdpa attention, its eager CE loss and torch AdamW in fp32, and prints one JSON line
when ready. Then each stdin line `run K` runs K training steps and prints, as JSON, each step's wall time
and the process's CPU time; `quit` ends it. A step is what speculators' trainer does per batch: the model's
forward (anchor selection, mask, the frozen verifier head's targets, the drafter, logits, loss and metrics),
backward, clip to 1.0, AdamW step.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config


class DraftModelSharingOneVocabularyMatrix(DFlashDraftModel):
    """speculators' drafter whose three vocabulary-sized matrices (embedding, LM head, verifier LM head) are
    created on the meta device, so that none is allocated before `build` replaces all three with one shared
    matrix: at Qwen3-8B's vocabulary each is 2.5 GB, and the transient three would not fit beside the other
    side of the benchmark."""

    def _init_vocab(self, config):
        with torch.device("meta"):
            super()._init_vocab(config)


def build(shape: dict, inputs_file: str):
    torch.manual_seed(0)
    layer_config = Qwen3Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["q_heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], max_position_embeddings=32768)
    layer_config._attn_implementation = "sdpa"
    block = shape["block"]
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=shape["vocab"], block_size=block,
        aux_hidden_state_layer_ids=list(range(1, 1 + shape["features"])), mask_token_id=shape["vocab"] - 1,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"])))
    model = DraftModelSharingOneVocabularyMatrix(config)
    # The verifier's embedding and LM head (frozen; NaN until loaded from a verifier): one shared random
    # matrix, as a model with tied embeddings has, so the vocabulary-sized memory is held once.
    vocab_matrix = torch.nn.Parameter(torch.randn(shape["vocab"], shape["hidden"]) * shape["hidden"] ** -0.5,
                                      requires_grad=False)
    model.embed_tokens.weight = vocab_matrix
    model.lm_head.weight = vocab_matrix
    model.verifier_lm_head.weight = vocab_matrix
    model.train()

    inputs = np.load(inputs_file)
    batch = {
        "hidden_states": torch.from_numpy(inputs["features"]),
        "verifier_last_hidden_states": torch.from_numpy(inputs["target_hidden"]),
        "input_ids": torch.from_numpy(inputs["input_ids"]).long(),
        "loss_mask": torch.ones(1, shape["seq_len"], dtype=torch.long),
        "document_ids": torch.zeros(1, shape["seq_len"], dtype=torch.long),
        "position_ids": torch.arange(shape["seq_len"]).unsqueeze(0),
        "loss_config": resolve_loss_config("ce", "eager"),
        "gamma": shape["gamma"],
        "max_anchors": shape["seq_len"] // shape["stride"],
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)

    def step() -> float:  # the body of speculators' Trainer.train_epoch loop, minus logging
        _, loss, _ = model(**batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    return model, step, batch


def attention_kernel(model, batch) -> str:
    """The aten kernel torch's sdpa dispatched to for this model's attention (one profiled forward)."""
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(**batch)
    names = sorted({event.key for event in profile.key_averages() if "scaled_dot_product" in event.key})
    return ", ".join(names) or "none found"


def main() -> None:
    shape = json.loads(sys.argv[1])
    torch.set_num_threads(shape["threads"])
    model, step, batch = build(shape, sys.argv[2])
    first_loss = step()  # warm-up (allocator, first-call paths)
    print(json.dumps({"ready": True, "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "attention": f"sdpa -> {attention_kernel(model, batch)}", "loss": first_loss}), flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[0] == "quit":
            break
        wall, cpu = [], []
        for _ in range(int(command[1])):
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = step()
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        print(json.dumps({"wall": wall, "cpu": cpu, "loss": loss}), flush=True)


if __name__ == "__main__":
    main()

"""The demo: a small drafter against the bundled toy target (dflash_jax/assets/toy_target), trained on its
target-regenerated data (dflash_jax/assets/toy_data). `make demo` runs, from the repository root:

    dflash-jax train --config configs/toy.py --workdir out/toy_run
    dflash-jax evaluate --config configs/toy.py --workdir out/toy_run --max_new_tokens 128
    dflash-jax export --workdir out/toy_run --out out/toy_drafter

It trains 1467 steps of 3 rows with Muon, about seven minutes on 2 CPU cores, and reaches the τ target (exact
τ >= 2 at B = 8; bench/RESULTS.md, "Toy drafter"). For its first few hundred steps the drafter sits on a plateau
where every slot predicts the token that follows the anchor; Muon at speculators' default rate for the weight
matrices (10x the base rate) leaves it after about 350 steps (with 4-row steps: 250, and AdamW about 650).
Paths are resolved from this file, so it runs from any directory.
"""

from pathlib import Path

from dflash_jax.train.config import base_config

ASSETS = Path(__file__).resolve().parents[1] / "dflash_jax" / "assets"


def get_config():
    config = base_config()
    config.target_dir = str(ASSETS / "toy_target")
    config.data.train_files = (str(ASSETS / "toy_data" / "train.jsonl"),)
    config.data.eval_files = (str(ASSETS / "toy_data" / "eval.jsonl"),)
    # fp32 throughout: the CPU has no fast bf16, and exact comparisons (vLLM, the generator) want fp32.
    config.target_dtype = "float32"
    config.compute_dtype = "float32"

    # The target has 4 layers, too few for design §2's default spread; take the last three (vLLM captures the
    # output of the last layer too). vLLM's CPU attention takes head_dim 32/64/80/96/112/128.
    config.drafter.num_hidden_layers = 2
    config.drafter.num_attention_heads = 4
    config.drafter.num_key_value_heads = 2
    config.drafter.head_dim = 64
    config.drafter.layer_types = ("full_attention",) * 2
    config.drafter.num_feature_layers = 3
    config.drafter.target_layer_ids = (1, 2, 3)

    config.drafter.block_size = 8
    config.loss.gamma = 4.0  # design §6: 4 for B = 8
    # A row holds one record: the longest (320 tokens) plus the largest phase shift (S - 1 = 7). Longer rows
    # would only add padding: records average 260 tokens, too many for two in a row.
    config.data.seq_len = 328
    config.data.anchor_stride = 8
    # 0.27-0.29 s a step on 2 idle CPU cores; 1467 steps see the 4,400 records (2.9 epochs) that 1100 steps of 4
    # rows did, in more, smaller updates (bench/RESULTS.md, "Toy drafter").
    config.data.batch_size = 3
    config.total_steps = 1467
    # Muon with vLLM speculators' defaults for `--lr 3e-3`: 3e-2 for the weight matrices (their updates scaled
    # to AdamW's RMS), 3e-3 and AdamW's betas (0.9, 0.999) for the norms.
    config.optim.name = "muon"
    config.optim.learning_rate = 3e-3
    config.optim.muon_learning_rate = 3e-2
    config.optim.b2 = 0.999
    config.optim.warmup_ratio = 0.05
    config.loss.vocab_chunk = 4096

    config.eval_prompts = 64
    config.checkpoint_every = 600
    config.keep_checkpoints = 1
    return config

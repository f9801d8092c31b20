"""Qwen3.6-27B (the target of qwen27b.py) with a DFlash2 drafter (design §18.4): vLLM speculators' published
DFlash2 recipe (its `dflash2` training defaults, as speculators 0.9.0's TrainConfig resolves them).

The drafter: 5 layers, block 8, the convolutions (2 taps, 16 channels per dynamic kernel group) and the selector
(rank 256, 16 candidates, loss weight 1); attention shapes from the target as speculators derives them (its
head_dim 256, 20 query heads = 5120 / 256 since 24 do not divide 5120, its 4 KV heads), the target's MLP width
17408, RoPE θ=1e7 on the full head (speculators' MRoPE full-head setting: text positions are 1-D), feature layers
[2, 32, 61] of the target (speculators' default [2, L/2, L-3], aux ids, here [1, 31, 60]); the loss forward KL
to the target's distribution with the fixed decay, γ=4; rows of 8192 tokens with 512 anchors (a stride-16 grid,
design §4, where speculators samples 512 positions); Muon at 1e-3 on the weight matrices and AdamW (weight
decay 0.01, betas (0.9, 0.999)) on the rest, Muon's weight decay 0.1, clipping 1.0, 20 epochs.

Departures and their reasons:
- Five full-attention layers where speculators has five sliding layers (W = 2048) that are bidirectional within
  the block (`sliding_window_non_causal`, DFlash2's default): this project's sliding layers are causal within
  the block (design §5, what vLLM serves for a sliding layer of a z-lab export), and the full layers keep the
  bidirectional block; they also see the whole row's context before the anchor, not only its last 2048
  positions.
- After the same warmup (1% of the steps), the learning rate decays along a cosine, the trainer's only
  schedule, where speculators' decays linearly.
- AdamW's weight decay skips the norm weights and the convolutions' base kernels (the trainer decays weight
  matrices only; speculators' AdamW decays every parameter it holds).
- One row per device (data.rows_per_device), so the config runs on any slice size, as qwen27b.py.

    dflash-jax train --config qwen27b_dflash2 --workdir /ckpt/dflash2-qwen27b \\
        --config.target_dir=/ckpt/Qwen3.6-27B --config.data.train_files=/data/train.jsonl
"""

from dflash_jax.configs.qwen27b import target_config  # noqa: F401 (the target's shapes, for plans and tests)
from dflash_jax.train.config import base_config


def get_config():
    config = base_config()
    config.drafter.method = "dflash2"
    config.drafter.num_hidden_layers = 5
    config.drafter.num_attention_heads = 20
    config.drafter.num_key_value_heads = 4
    config.drafter.head_dim = 256
    config.drafter.intermediate_size = 17408
    config.drafter.layer_types = ("full_attention",) * 5
    config.drafter.num_feature_layers = 3
    config.drafter.target_layer_ids = (1, 31, 60)
    config.drafter.rope_theta = 1e7
    config.drafter.mask_token_id = 248070
    config.drafter.block_size = 8
    # conv_kernel_size 2, conv_group_size 16, selector_rank 256, selector_top_k 16, selector_alpha 1: the
    # defaults of train/config.py, speculators' own.
    config.loss.terms = "kl"
    config.loss.position_weights = "decay"
    config.loss.gamma = 4.0
    config.data.seq_len = 8192
    config.data.anchor_stride = 16  # N = 512 anchors per row
    config.data.rows_per_device = 1
    config.epochs = 20
    config.optim.name = "muon"
    config.optim.learning_rate = 1e-3
    config.optim.muon_learning_rate = 1e-3
    config.optim.weight_decay = 0.01
    config.optim.muon_weight_decay = 0.1
    config.optim.b2 = 0.999
    config.optim.warmup_ratio = 0.01
    return config

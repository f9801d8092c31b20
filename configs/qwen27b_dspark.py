"""A DSpark drafter for Qwen3.6-27B (design §18): vLLM speculators 0.9.0's published DSpark defaults
(`speculators train --speculator-type dspark`) on the target of configs/qwen27b.py.

    dflash-jax train --config qwen27b_dspark --workdir /ckpt/dspark-qwen27b \\
        --config.target_dir=/ckpt/Qwen3.6-27B --config.data.train_files=/data/train.jsonl

speculators' defaults, kept: 5 draft layers, all sliding-window attention (W = 2048, causal within the block);
the target's attention shape (24 query / 4 KV heads x 256) and MLP width (17408); feature layers [2, L/2, L-3]
of the target's hidden states counted from 1 (here [2, 32, 61], our ids one lower); B = 8 with every slot
drafted (`sample_from_anchor`, B tokens per step); the vanilla Markov head of rank 256 and the confidence head on
[h; W1[prev]] with weight 1.0; the forward KL to the target's whole distribution with the fixed position decay
γ = 4; rows of 8192 tokens with 512 anchors each; 20 epochs of Muon at lr 1e-3 on the weight matrices and AdamW
at 1e-3 on the rest (Muon's update scaled to AdamW's RMS), weight decay 0.1 (Muon) and 0.01 (AdamW), AdamW's
betas (0.9, 0.999), 1% warmup, clipping 1.0; the full vocabulary (no reduced draft vocabulary).

Departures and their reasons:
- anchors sit on a static grid of stride 16 (512 per 8192-token row, design §4), where speculators samples 512
  supervised positions at random: static shapes for the compiled step;
- the learning rate decays by cosine after the warmup, where speculators decays linearly: the trainer's one
  schedule (design §7), which ends at 0 as speculators' does;
- AdamW decays only the weight matrices (speculators also decays the norm weights): the trainer's rule;
- the sliding window's edge is vLLM's (context p is visible to slot k iff a + k - W < p, design §5), where
  speculators trains with a - W <= p: the drafter trains as it is served;
- one 8192-token row per device (data.rows_per_device), so the recipe runs on a slice of any size, its global
  batch growing with the slice, as speculators' one packed sequence per GPU;
- the mask token is 248070, as configs/qwen27b.py (speculators takes it from the command line).
"""

from dflash_jax.configs import qwen27b
from dflash_jax.train.config import base_config

target_config = qwen27b.target_config  # the target's text-model shapes (configs/qwen27b.py)


def get_config():
    config = base_config()
    config.drafter.method = "dspark"
    config.drafter.markov_rank = 256
    config.drafter.confidence_alpha = 1.0
    config.drafter.num_hidden_layers = 5
    config.drafter.num_attention_heads = 24
    config.drafter.num_key_value_heads = 4
    config.drafter.head_dim = 256
    config.drafter.intermediate_size = 17408
    config.drafter.layer_types = ("sliding_attention",) * 5
    config.drafter.sliding_window = 2048
    config.drafter.num_feature_layers = 3
    config.drafter.target_layer_ids = (1, 31, 60)  # speculators' [2, L // 2, L - 3] for L = 64, minus one
    # Plain 1-D RoPE on the full head_dim: speculators' draft_mrope_full_head_hack (sections over the whole head,
    # partial factor 1), which text positions reduce to.
    config.drafter.rope_theta = 1e7
    config.drafter.mask_token_id = 248070
    config.drafter.block_size = 8
    config.loss.terms = {"kl": 1.0}
    config.loss.position_weights = "decay"
    config.loss.gamma = 4.0
    config.data.seq_len = 8192
    config.data.anchor_stride = 16  # N = 512 anchors per row
    config.data.rows_per_device = 1
    config.epochs = 20  # total_steps follows from the corpus's size (train/epochs.py)
    config.optim.name = "muon"
    config.optim.learning_rate = 1e-3
    config.optim.weight_decay = 0.01
    config.optim.muon_weight_decay = 0.1
    config.optim.b2 = 0.999
    config.optim.warmup_ratio = 0.01
    return config

"""The training configuration: every field, its default, and what it means.

Config files under `configs/` start from `base_config()` and override what differs (big_vision style):

    from dflash_jax.train.config import base_config
    def get_config():
        config = base_config()
        config.target_dir = "/ckpt/Qwen3-8B"
        return config

Any field can be overridden on the command line: `--config.seq_len=2048`.
"""

from __future__ import annotations

from ml_collections import ConfigDict, config_dict

placeholder = config_dict.placeholder


def base_config() -> ConfigDict:
    config = ConfigDict()

    # Target: a Hugging Face checkpoint directory (or an Orbax one written by convert/hf_to_orbax.py).
    config.target_dir = placeholder(str)
    config.tokenizer_dir = placeholder(str)  # default: target_dir
    config.target_dtype = "bfloat16"  # frozen target weights and its forward
    config.compute_dtype = "bfloat16"  # drafter compute; its weights and optimizer state stay fp32 (SPEC §7)

    # Drafter (SPEC §3, §11). None = derived from the target: hidden size (must equal the target's),
    # intermediate size, rope theta/scaling, rms eps, vocab size, max positions.
    config.drafter = ConfigDict()
    config.drafter.num_hidden_layers = 5
    config.drafter.num_attention_heads = 32
    config.drafter.num_key_value_heads = 8
    config.drafter.head_dim = 128
    config.drafter.intermediate_size = placeholder(int)
    config.drafter.hidden_size = placeholder(int)
    config.drafter.layer_types = ("full_attention",) * 5
    config.drafter.sliding_window = placeholder(int)
    config.drafter.num_feature_layers = 5  # feature ids default to SPEC §2's spread over the target
    config.drafter.target_layer_ids = placeholder(tuple)
    config.drafter.rope_theta = placeholder(float)
    config.drafter.rope_scaling = placeholder(dict)
    config.drafter.rms_norm_eps = 1e-6
    config.drafter.mask_token_id = placeholder(int)  # else the tokenizer's mask token, else len(tokenizer)
    config.drafter.init_from = placeholder(str)  # a drafter directory in the export layout to fine-tune

    # Block, anchors, loss (SPEC §4, §6).
    config.block_size = 16
    config.gamma = 7.0  # position-weight decay; 7 for B=16, 4 for B=8
    config.seq_len = 4096  # T: tokens per packed row
    config.anchor_stride = 16  # S: anchors at j*S, N = T/S blocks per row
    config.labels = "target"  # "target": argmax of the target's logits; "data": the row's next tokens
    config.noise_std = 0.0  # uniform noise U(-std, std) on the raw features fed to fc (never on labels)
    config.vocab_chunk = 8192  # vocabulary chunk for the target's greedy labels
    config.loss_row_chunk = 512  # block tokens per batch row in one LM head + cross-entropy chunk

    # Attention of the drafter (SPEC §5 mask) and of the target's forward (causal within documents):
    # "auto" = splash on TPU, XLA elsewhere (the target's XLA path walks 512-query chunks).
    config.attention_impl = "auto"
    config.query_chunk_blocks = 16  # blocks per query chunk in the XLA drafter attention

    # Data (JSONL: {"messages": [...]} or {"prompt", "completion"}).
    config.train_files = placeholder(tuple)
    config.eval_files = placeholder(tuple)
    config.batch_size = 8  # rows per step (global, split over the data and fsdp mesh axes)
    config.shuffle_seed = 0
    config.bad_records = "raise"  # or "skip": log and count bad JSONL records instead of stopping
    config.chat_template_kwargs = placeholder(dict)  # e.g. {"enable_thinking": False}

    # Optimisation (SPEC §7).
    config.total_steps = 10_000
    config.learning_rate = 6e-4
    config.warmup_ratio = 0.04
    config.weight_decay = 0.0
    config.adam_b1 = 0.9
    config.adam_b2 = 0.95
    config.clip_grad_norm = 1.0
    config.grad_accum_steps = 1  # micro-batches of batch_size / grad_accum_steps rows, one update per step
    config.seed = 0  # drafter init and the noise RNG

    # Mesh: one of the sizes may be -1 (take the remaining devices).
    config.mesh = ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    # Several processes (multi-host pods), joined by jax.distributed.initialize before anything else:
    # "auto" = when JAX_COORDINATOR_ADDRESS is set (with JAX_NUM_PROCESSES, JAX_PROCESS_ID); "on" = always,
    # JAX detecting the rest (Cloud TPU pod slices, Slurm, Open MPI); "off" = one process.
    config.distributed = "auto"

    # Bookkeeping.
    config.log_every = 10
    config.eval_every = 0  # 0 = no evaluation during training
    config.eval_prompts = 32
    config.checkpoint_every = 500
    config.keep_checkpoints = 3
    config.peak_tflops_per_device = placeholder(float)  # for MFU; None = look up the device kind
    return config

"""The training configuration: every field, its default, and what it means.

Config files under `configs/` start from `base_config()` and override what differs (big_vision style):

    from dflash_jax.train.config import base_config
    def get_config():
        config = base_config()
        config.target_dir = "/ckpt/Qwen3-8B"
        config.data.seq_len = 2048
        return config

Any field can be overridden on the command line: `--config.data.seq_len=2048`. Fields are grouped by what they
configure: `drafter` (its architecture), `data` (rows and files), `loss`, `optim`, `mesh`; the rest (target, attention
backend, schedule length, bookkeeping) sit at the top level. An unknown or renamed `--config.<field>` is one line naming the
field to use (`validate.check_overrides`).
"""

from __future__ import annotations

from ml_collections import ConfigDict, config_dict

from dflash_jax.ops.anchors import AnchorGrid

placeholder = config_dict.placeholder

# Fields that moved into a group, old name -> new path. A config file or flag still using an old name gets one
# line naming the new one.
RENAMED = {
    "block_size": "drafter.block_size",
    "gamma": "loss.gamma", "labels": "loss.labels", "noise_std": "loss.noise_std", "vocab_chunk": "loss.vocab_chunk",
    "loss_row_chunk": "loss.row_chunk",
    "train_files": "data.train_files", "eval_files": "data.eval_files", "seq_len": "data.seq_len",
    "anchor_stride": "data.anchor_stride", "batch_size": "data.batch_size", "shuffle_seed": "data.shuffle_seed",
    "bad_records": "data.bad_records", "chat_template_kwargs": "data.chat_template_kwargs",
    "learning_rate": "optim.learning_rate", "warmup_ratio": "optim.warmup_ratio",
    "weight_decay": "optim.weight_decay", "adam_b1": "optim.b1", "adam_b2": "optim.b2",
    "clip_grad_norm": "optim.clip_grad_norm",
}
# Fields that are gone, name -> what does their work now (one line for a config file or flag still setting one).
REMOVED = {"plan_only": "`dflash-jax plan --config <file>` prints the plan without training",
           "drafter.hidden_size": "the drafter's width is the target's hidden_size (fc reads n x H target features "
                                  "and the target's embedding and LM head are shared)"}


def base_config() -> ConfigDict:
    config = ConfigDict()

    # Target: a Hugging Face checkpoint directory (or an Orbax one written by convert/hf_to_orbax.py).
    config.target_dir = placeholder(str)
    config.tokenizer_dir = placeholder(str)  # default: target_dir
    config.target_dtype = "bfloat16"  # frozen target weights and its forward
    # The products inside a hybrid target's Gated DeltaNet chunks (design §8.3): "bfloat16" operands with fp32
    # accumulation (tensor-core speed), "float32" (exact, Precision.HIGHEST), "auto" = bfloat16 on TPU and GPU,
    # float32 on CPU. The recurrent state, the triangular inverse and the state carried across chunks stay fp32.
    # Training, evaluation and regeneration load the target with it alike.
    config.target_matmul_dtype = "auto"
    config.compute_dtype = "bfloat16"  # drafter compute; its weights and optimizer state stay fp32 (design §7)

    # Drafter (design §3, §11). None = derived from the target: hidden size (must equal the target's),
    # intermediate size, rope theta/scaling, rms eps, vocab size, max positions.
    config.drafter = ConfigDict()
    config.drafter.block_size = 16  # B: slot 0 is the anchor's real token, slots 1..B-1 are drafted
    config.drafter.num_hidden_layers = 5
    config.drafter.num_attention_heads = 32
    config.drafter.num_key_value_heads = 8
    config.drafter.head_dim = 128
    config.drafter.intermediate_size = placeholder(int)
    config.drafter.layer_types = ("full_attention",) * 5
    config.drafter.sliding_window = placeholder(int)
    # The target layers fc reads: target_layer_ids, or num_feature_layers of them spread as design §2 spreads
    # them (None: 5; given ids, None is their number).
    config.drafter.num_feature_layers = placeholder(int)
    config.drafter.target_layer_ids = placeholder(tuple)
    config.drafter.rope_theta = placeholder(float)
    config.drafter.rope_scaling = placeholder(dict)  # else the target's; on the command line as JSON (design §8.6)
    config.drafter.rms_norm_eps = 1e-6
    config.drafter.mask_token_id = placeholder(int)  # else the tokenizer's mask token, else len(tokenizer)
    config.drafter.init_from = placeholder(str)  # a drafter directory in the export layout to fine-tune
    # The drafter family member (design §18): "dflash" (the backbone alone), "dspark" (plus the low-rank Markov
    # logit bias from the previous token and the per-slot confidence head), "dflash2" (plus the dynamic two-tap
    # convolutions and the candidate selector).
    config.drafter.method = "dflash"
    config.drafter.markov_rank = 256  # dspark: rank r of the Markov bias W2·W1[prev]
    config.drafter.confidence_alpha = 1.0  # dspark: weight of the confidence head's BCE in the loss
    # dflash2 (vLLM speculators' defaults): taps K and channels per dynamic kernel group of the convolutions; rank
    # and candidates K of the selector; weight of the selector's K-way cross-entropy in the loss.
    config.drafter.conv_kernel_size = 2
    config.drafter.conv_group_size = 16
    config.drafter.selector_rank = 256
    config.drafter.selector_top_k = 16
    config.drafter.selector_alpha = 1.0

    # Data: JSONL records ({"messages": [...]} or {"prompt", "completion"}) packed into rows (design §4).
    config.data = ConfigDict()
    config.data.train_files = placeholder(tuple)
    config.data.eval_files = placeholder(tuple)
    config.data.seq_len = 4096  # T: tokens per packed row
    config.data.anchor_stride = 16  # S: anchors at j*S, N = T/S blocks per row
    # At most this many anchors a row (None: T/S): a longer row widens the stride to the smallest multiple of S
    # that keeps N <= max_anchors, so the blocks stay spread over the whole row (ops/anchors.py). 512 is vLLM
    # speculators' default (DataArgs.max_anchors, per packed row), SpecForge's num_anchors and the DFlash paper's
    # blocks per sequence; the 4K-row recipes already hold 512, so only rows past 512 x S change.
    config.data.max_anchors = 512
    # Rows a step: data.batch_size (global, split over the data and fsdp mesh axes), or rows per device,
    # batch_size = rows_per_device x the mesh's data x fsdp size, so that one config runs on a slice of any size.
    # Neither given: one row per device. A given batch_size takes precedence (warned).
    config.data.batch_size = placeholder(int)
    config.data.rows_per_device = placeholder(int)
    config.data.shuffle_seed = 0
    config.data.bad_records = "raise"  # or "skip": log and count bad JSONL records instead of stopping
    # Arguments of the chat template (e.g. {"enable_thinking": False}): a dict in a config file; on the command line
    # a JSON object (`--config.data.chat_template_kwargs='{"enable_thinking": false}'`) or a Python dict literal.
    config.data.chat_template_kwargs = placeholder(object)

    # Labels and loss (design §6).
    config.loss = ConfigDict()
    # Position weights of the drafted slots: "decay" = exp(-(k-1)/gamma); "dpace" = D-PACE, the expected number
    # of accepted slots each slot gates, from the drafter's detached confidence smoothed by dpace_alpha (vLLM
    # speculators' `--per-position-loss-weight dpace`). D-PACE is the default: on the toy demo it reaches exact τ
    # 2.602 where the decay reaches 2.407 at the same steps (bench/RESULTS.md, "Position weights").
    config.loss.position_weights = "dpace"
    config.loss.gamma = 7.0  # decay rate (position_weights "decay"); 7 for B=16, 4 for B=8
    config.loss.dpace_alpha = 0.5  # D-PACE smoothing: s = (1 - alpha) exp(-CE) + alpha
    config.loss.labels = "target"  # "target": argmax of the target's logits; "data": the row's next tokens
    # The loss terms and their weights (design §18): "ce" (hard labels), "kl" (forward KL to the target's
    # distribution), "rkl", "jsd", "tv"; None = {"ce": 1.0}. A dict in a config file; on the command line a JSON
    # object (`--config.loss.terms='{"ce": 0.1, "tv": 0.9}'`) or one name (`--config.loss.terms=kl`). D-PACE
    # position weights are defined for "ce" alone.
    config.loss.terms = placeholder(object)
    config.loss.noise_std = 0.0  # uniform noise U(-std, std) on the raw features fed to fc (never on labels)
    config.loss.vocab_chunk = 8192  # vocabulary chunk for the target's greedy labels
    config.loss.row_chunk = 512  # block tokens per batch row in one LM head + cross-entropy chunk

    # How the frozen target's weights lie on the mesh (dflash_jax/sharding.py TARGET_LAYOUTS): "fsdp" = split over
    # fsdp and tensor (least memory; each layer's weights are all-gathered as it runs), "tensor" = split over
    # tensor only (heads, MLP, vocabulary; a whole copy per (data, fsdp) group, no weight traffic), "replicate" =
    # whole on every device. "auto": the one with the least weight traffic whose target takes at most half of a
    # device's memory (replicate, else tensor, else fsdp; fsdp where the devices report no memory), see
    # `dflash-jax plan --compare` for the layouts and meshes ranked by predicted time per token.
    config.target_layout = "auto"

    # Attention of the drafter (design §5 mask) and of the target's forward (causal within documents):
    # "auto" = splash on TPU, cuDNN on GPU (the target's causal attention; the drafter's runs in XLA there), XLA
    # elsewhere (the target's XLA path walks 512-query chunks); "cudnn" off GPU falls back to XLA with a warning.
    config.attention_impl = "auto"
    # Blocks per query chunk of the drafter's XLA attention, a memory knob only (one scan walks every chunk's key
    # tiles, ops/dflash_attention.py): 16 blocks of 16 slots score 256 queries at a time against a tile of at most
    # 512 positions, for the 27B drafter's 32 heads 14-16 MiB of fp32 scores a row.
    config.query_chunk_blocks = 16

    # Optimisation (design §7).
    # The schedule's length: total_steps, or epochs (passes over the corpus; total_steps is then derived from its
    # token count and the tokens a step holds, train/epochs.py). A given total_steps takes precedence (warned),
    # so `--config.total_steps=N` shortens a recipe given in epochs.
    config.total_steps = placeholder(int)
    config.epochs = placeholder(float)
    config.grad_accum_steps = 1  # micro-batches of batch_size / grad_accum_steps rows, one update per step
    config.seed = 0  # drafter init and the noise RNG
    config.optim = ConfigDict()
    config.optim.name = "adamw"  # or "muon": Muon on the weight matrices, AdamW on the norms (train/optimizer.py)
    config.optim.learning_rate = 6e-4
    config.optim.warmup_ratio = 0.04
    config.optim.weight_decay = 0.0
    config.optim.b1 = 0.9
    config.optim.b2 = 0.95
    config.optim.clip_grad_norm = 1.0
    # Muon (optim.name = "muon"; vLLM speculators' defaults). Its updates are scaled to AdamW's size, so its
    # learning rate is on AdamW's scale; both parts follow the same warmup + cosine schedule.
    config.optim.muon_learning_rate = placeholder(float)  # peak for the weight matrices; None = learning_rate
    config.optim.muon_momentum = 0.95
    config.optim.muon_nesterov = True
    config.optim.muon_ns_steps = 5  # Newton-Schulz iterations
    config.optim.muon_ns_dtype = "bfloat16"  # Newton-Schulz operands ("float32": exact, slower on accelerators)
    config.optim.muon_weight_decay = 0.1  # decoupled, times the scheduled learning rate

    # Memory (design §13). Rematerialisation of the drafter layers in the backward: "none", "full" (keep each
    # layer's input only), "dots" (keep the weight matmuls' outputs) or "attention" (keep the attention output).
    # The frozen target needs none: no gradient flows through it, so its forward keeps only the feature layers.
    config.remat = "none"
    # The ahead-of-time plan (dflash_jax/planning/plan.py): the step compiled from abstract arrays before any weight is
    # read; it must fit config.hbm_gib per device (None = the device's own memory when it reports one).
    # `dflash-jax plan` prints the plan without training.
    config.hbm_gib = placeholder(float)

    # Mesh: one of the sizes may be -1 (take the remaining devices). dcn_data > 1 spans the data axis over that
    # many TPU slices or GPU hosts as well (the sizes are then those within one), so only data parallelism's
    # gradient all-reduce crosses the slow links between them and fsdp / tensor stay inside (design §13).
    # context > 1 splits each row's tokens into that many contiguous shards, one per device (design §19): for
    # rows whose activations outgrow a device; data.seq_len must be a multiple of it.
    config.mesh = ConfigDict(dict(data=1, fsdp=-1, tensor=1, dcn_data=1, context=1))
    # On accelerators, train chooses the mesh and layout (design §13.1) when this is True, or when it is None and
    # the mesh is left as above by the recipe and by the command line (a --config.mesh.* flag, even one giving a
    # default value, makes the mesh given); False: the mesh as given, always.
    config.choose_mesh = placeholder(bool)
    # Several processes (multi-host pods), joined by jax.distributed.initialize before anything else:
    # "auto" = when JAX_COORDINATOR_ADDRESS is set (with JAX_NUM_PROCESSES, JAX_PROCESS_ID); "on" = always,
    # JAX detecting the rest (Cloud TPU pod slices, Slurm, Open MPI); "off" = one process.
    config.distributed = "auto"

    # Bookkeeping.
    config.log_every = 10
    config.eval_every = 0  # 0 = no evaluation during training
    config.eval_prompts = 32
    # What τ is measured on, during training and by `dflash-jax evaluate` alike (design §9): "generate" = the
    # target's own greedy continuation of each prompt, up to eval_max_new_tokens; "data" = the record's own.
    config.eval_continuation = "generate"
    config.eval_max_new_tokens = 256
    config.checkpoint_every = 500
    config.keep_checkpoints = 3
    # Remote storage (gs://, design §7.2): one operation (a read, write, listing, upload, checkpoint save) is
    # given up after deadline_seconds (plus time for its bytes at 8 MiB/s) and `retries` retries with backoff,
    # and the command exits with code 74 (retryable). None = $DFLASH_JAX_STORAGE_DEADLINE_SECONDS /
    # $DFLASH_JAX_STORAGE_RETRIES, else 600 s and 8 (runtime/storage.py).
    config.storage = ConfigDict()
    config.storage.deadline_seconds = placeholder(float)
    config.storage.retries = placeholder(int)
    # After SIGTERM/SIGINT (design §7.3), the rest of the run (the step in flight, its metrics, the checkpoint
    # save, closing the files) gets this many seconds; past them the process exits with code 76 and one line
    # naming the last complete checkpoint, where the rerun resumes. Below the notice schedulers give between
    # their SIGTERM and their kill, 30 s at the short end (Compute Engine preemption, Kubernetes' default grace
    # period, Slurm's default KillWait) and up to 120 s elsewhere, so that the process ends on its own, with
    # that line, before a kill would end it without one.
    config.stop_grace_seconds = 25.0
    config.peak_tflops_per_device = placeholder(float)  # for MFU; None = look up the device kind
    # XLA's persistent compilation cache (set by the train command): a rerun with the same shapes, such as a
    # resume after preemption, loads the compiled step instead of compiling it again. None = JAX's own setting
    # (JAX_COMPILATION_CACHE_DIR) if any, else <workdir>/compilation_cache; "off" = no cache; else a directory
    # (local or gs://).
    config.compilation_cache_dir = placeholder(str)
    # (first, last): a jax.profiler trace of steps first..last (counted from 1), written under
    # <workdir>/profile for TensorBoard's profile plugin or Perfetto; None = no trace.
    config.profile_steps = placeholder(tuple)

    # Experiment tracking (train/tracking.py), besides <workdir>/metrics.jsonl: TensorBoard event files in
    # <workdir>/tensorboard, and Weights & Biases when a project is named (needs `pip install wandb`).
    config.tensorboard = True
    config.wandb_project = placeholder(str)
    config.wandb_entity = placeholder(str)  # W&B team or user; None = the logged-in user's default
    return config


def field_paths(config: ConfigDict, prefix: str = "") -> list[str]:
    """Every leaf field of a config as a dotted path ("data.seq_len", "mesh.fsdp", "target_dir", ...)."""
    paths = []
    for key, value in config.items():
        if isinstance(value, ConfigDict):
            paths.extend(field_paths(value, f"{prefix}{key}."))
        else:
            paths.append(f"{prefix}{key}")
    return paths


def anchor_grid(config: ConfigDict) -> AnchorGrid:
    """The static anchor grid of the config's rows: data.anchor_stride, widened for data.max_anchors."""
    data = config.data
    return AnchorGrid.for_rows(data.seq_len, data.anchor_stride, config.drafter.block_size, data.max_anchors)

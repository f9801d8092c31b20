"""Train the toy target (this project's JAX Qwen3) as a plain next-token language model, measure it, and
save it in Hugging Face format."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from transformers import GenerationConfig, PreTrainedTokenizerFast

from dflash_jax.models.qwen3 import Qwen3, Qwen3Config
from dflash_jax.weights.hf_qwen3_writer import save_qwen3
from tools.toy_target.corpus import EOS, encode

SEED = 0
# Qwen3 architecture, tied embeddings; vocab_size is derived from the tokenizer.
MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
             tie_word_embeddings=True, max_position_embeddings=2048)
SAVE_DTYPE = "bfloat16"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def model_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    # Strictly more embedding rows than tokens, rounded to a multiple of 64 (as real Qwen checkpoints do).
    vocab_size = (len(tokenizer) // 64 + 1) * 64
    return Qwen3Config(vocab_size=vocab_size, rope_scaling=None, **MODEL)


def forward_logits(model: Qwen3, input_ids: jax.Array) -> jax.Array:
    """[B, T] ids (one document per row, positions from 0) -> fp32 logits [B, T, V]."""
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
    hidden = model(input_ids, positions, jnp.zeros_like(input_ids)).hidden
    return model.logits(hidden).astype(jnp.float32)


def token_losses(model: Qwen3, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token cross-entropy (nats) and whether the argmax was right, both [B, T]."""
    logits = forward_logits(model, inputs)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - target_logit, jnp.argmax(logits, axis=-1) == targets


@nnx.jit
def train_step(model: Qwen3, optimizer: nnx.Optimizer, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    def loss_fn(model):
        return jnp.mean(token_losses(model, inputs, targets)[0])

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def eval_step(model: Qwen3, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    losses, correct = token_losses(model, inputs, targets)
    return jnp.sum(losses), jnp.sum(correct)


def random_windows(stream: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int):
    """Inputs and next-token targets from `batch` random windows of the packed stream."""
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    windows = np.stack([stream[s:s + seq_len + 1] for s in starts])
    return jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])


def evaluate(model: Qwen3, stream: np.ndarray, seq_len: int, max_windows: int, batch: int = 16) -> dict:
    """Mean loss (nats/token) and top-1 accuracy over evenly spaced, non-overlapping windows of `stream`."""
    count = min(max_windows, (len(stream) - 1) // seq_len)
    starts = np.linspace(0, len(stream) - seq_len - 1, count).astype(np.int64)
    starts = starts[: len(starts) // batch * batch] if len(starts) >= batch else starts
    total_loss = total_correct = 0.0
    for i in range(0, len(starts), batch):
        windows = np.stack([stream[s:s + seq_len + 1] for s in starts[i:i + batch]])
        loss, correct = eval_step(model, jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:]))
        total_loss, total_correct = total_loss + float(loss), total_correct + float(correct)
    tokens = len(starts) * seq_len
    return {"loss": total_loss / tokens, "accuracy": total_correct / tokens, "tokens": tokens}


def train(config: Qwen3Config, stream: np.ndarray, args, probe: Callable[[Qwen3], str]) -> Qwen3:
    """AdamW with warmup + cosine on random windows of `stream`; `probe(model)` is logged every
    args.probe_every steps."""
    model = Qwen3(config, param_dtype=jnp.float32, rngs=nnx.Rngs(SEED))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=args.lr, warmup_steps=max(1, args.steps // 20), decay_steps=args.steps,
        end_value=args.lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.01))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = np.random.default_rng(SEED)
    tokens_per_step = args.batch * args.seq_len
    log(f"training {args.steps} steps x {tokens_per_step} tokens "
        f"({args.steps * tokens_per_step / len(stream):.2f} epochs of {len(stream)} LM tokens)")
    started, window_start, window_loss = time.time(), time.time(), []
    for step in range(1, args.steps + 1):
        inputs, targets = random_windows(stream, rng, args.batch, args.seq_len)
        window_loss.append(train_step(model, optimizer, inputs, targets))
        if step % args.log_every == 0 or step == args.steps:
            loss = float(np.mean([float(x) for x in window_loss]))  # also waits for the steps to finish
            rate = len(window_loss) * tokens_per_step / (time.time() - window_start)
            log(f"step {step:5d}/{args.steps}  loss {loss:.4f}  lr {float(schedule(step)):.2e}  "
                f"{rate:,.0f} tokens/s  elapsed {time.time() - started:.0f}s")
            window_start, window_loss = time.time(), []
        if step % args.probe_every == 0 and step != args.steps:
            log(f"  probe at step {step}: {probe(model)}")
    log(f"training took {time.time() - started:.0f}s")
    return model


def save_target(model: Qwen3, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    save_qwen3(model, out_dir, dtype=SAVE_DTYPE, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    save_tokenizer(tokenizer, out_dir)
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False,
                     max_new_tokens=256).save_pretrained(out_dir)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json readable by transformers v5 and by v4-based tools (vLLM).

    transformers v5 writes `tokenizer_class: TokenizersBackend`, a list under `extra_special_tokens` and the
    template as chat_template.jinja; v4 knows none of these. The v4 spelling below loads the same in v5.
    """
    tokenizer.save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["additional_special_tokens"] = config.pop("extra_special_tokens", ["<|im_start|>", "<|im_end|>"])
    config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)


def check_against_transformers(target_dir: Path, model: Qwen3, tokenizer, text: str) -> float:
    """Max |logit difference| between the reloaded JAX model and transformers on `text` (both fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = encode(tokenizer, text)[:200]
    torch_model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch_model(torch.tensor([ids])).logits[0].numpy()
    got = np.asarray(forward_logits(model, jnp.asarray([ids], jnp.int32))[0])
    return float(np.max(np.abs(got - expected)))

"""Build the bundled toy target and its drafter data.

The toy target is a small Qwen3-architecture language model of Python code, trained with this project's
own JAX model on a corpus every machine has offline: the running interpreter's standard library sources
(`*.py` under `sysconfig.get_paths()["stdlib"]`, sorted by path, test suites and generated tables left
out). Steps:

1. Split the files BY NAME with a hash of the relative path: most train the language model; the held-out
   rest is split again into drafter-train and drafter-eval files (disjoint), and all held-out files give
   the held-out loss.
2. Train a byte-level BPE tokenizer on the LM files (HF `tokenizers`), wrap it as a
   `PreTrainedTokenizerFast` with a ChatML chat template and a `<|mask|>` token.
3. Train the model (AdamW, warmup + cosine) on random 512-token windows of the LM files.
4. Save it in Hugging Face format (bf16) to dflash_jax/assets/toy_target/, reload it with `load_qwen3` and
   with transformers, and check both give the same logits.
5. Write target-regenerated drafter data to dflash_jax/assets/toy_data/{train,eval}.jsonl: prompts are
   code prefixes cut at line ends from held-out files, completions are the saved model's greedy
   continuations (batched, KV-cached greedy decoding in JAX, checked against the uncached forward).
6. Report the held-out loss and how varied the continuations are, and write toy_target/README.md.

Run (from the repository root; about 30 minutes on 2 CPU cores):
    .venv/bin/python tools/make_toy_target.py
Smoke run (a minute or two; writes under /tmp/dflash_toy_quick unless --assets is given):
    .venv/bin/python tools/make_toy_target.py --quick
"""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import json
import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash_jax.models.layers import apply_rope, rope_inverse_frequencies  # noqa: E402
from dflash_jax.models.qwen3 import Qwen3, Qwen3Config  # noqa: E402
from dflash_jax.ops.attention import grouped_attention  # noqa: E402
from dflash_jax.weights.hf_qwen3 import load_qwen3  # noqa: E402
from dflash_jax.weights.hf_qwen3_writer import save_qwen3  # noqa: E402

SEED = 0

# Corpus. Directories whose files are fixtures, data or generated tables rather than ordinary code.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data",
                 "lib-dynload"}
HELDOUT_PERCENT = 16  # files with hash bucket < 16 (of 100) are held out of LM training
EVAL_PERCENT = 4  # ... and those with bucket < 4 are the drafter's eval files

# Tokenizer.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
EOS, MASK = "<|endoftext|>", "<|mask|>"
TOKENIZER_SIZE = 4000
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Model (Qwen3 architecture, tied embeddings). vocab_size is derived from the tokenizer.
MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
             tie_word_embeddings=True, max_position_embeddings=2048)
SAVE_DTYPE = "bfloat16"

# Drafter data: prompt length range in tokens (prompt + completion must fit the trained sequence length).
PROMPT_MIN, PROMPT_MAX = 64, 192


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 2000; --quick: 20)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=512,
                        help="tokens per training sequence (covers the 192 + 128 of prompt + completion)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--probe-every", type=int, default=200, help="steps between held-out/greedy probes")
    parser.add_argument("--train-records", type=int, default=None, help="drafter train records (default 1536)")
    parser.add_argument("--eval-records", type=int, default=None, help="drafter eval records (default 64)")
    parser.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per completion (default 128)")
    parser.add_argument("--assets", type=Path, default=None,
                        help="output root holding toy_target/ and toy_data/ (default dflash_jax/assets; "
                             "--quick: /tmp/dflash_toy_quick)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny corpus, few steps, few records")
    args = parser.parse_args()
    quick = args.quick
    args.steps = args.steps or (20 if quick else 2000)
    args.train_records = args.train_records or (16 if quick else 1536)
    args.eval_records = args.eval_records or (8 if quick else 64)
    args.new_tokens = args.new_tokens or (16 if quick else 128)
    args.assets = args.assets or (Path("/tmp/dflash_toy_quick") if quick else REPO / "dflash_jax" / "assets")
    return args


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ----------------------------------------------------------------------------------------------------------
# Corpus and splits


def stdlib_files() -> list[tuple[str, str]]:
    """(relative path, text) of every stdlib *.py file that is ordinary code, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        directories = relative.split("/")[:-1]
        if any(d in EXCLUDED_DIRS or d.startswith("config-") for d in directories):
            continue
        if path.name.startswith("_sysconfigdata"):  # machine-specific build settings, not code
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            files.append((relative, text))
    return files


def split_of(relative_path: str) -> str:
    """'lm', 'drafter_train' or 'drafter_eval', decided by the file's name alone (stable across runs)."""
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % 100
    if bucket < EVAL_PERCENT:
        return "drafter_eval"
    if bucket < HELDOUT_PERCENT:
        return "drafter_train"
    return "lm"


# ----------------------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style pre-tokenizer, no prefix space) with the special tokens at ids 0..3."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_SIZE, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS, mask_token=MASK,
                                        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def token_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> np.ndarray:
    """All texts tokenized and concatenated, each followed by <|endoftext|> (GPT-style document packing)."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids + [eos], np.int32) for e in encodings])


# ----------------------------------------------------------------------------------------------------------
# Training


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


def probe(model: Qwen3, tokenizer, heldout: np.ndarray, prompts: list[dict], args) -> str:
    """Held-out loss on a few windows and how varied greedy continuations of a few eval prompts are."""
    result = evaluate(model, heldout, args.seq_len, max_windows=16)
    generations = greedy_generate(model, [p["ids"] for p in prompts], args.new_tokens, PROMPT_MAX, len(prompts))
    stats = diversity(generations)
    texts = [tokenizer.decode(ids) for ids in generations]
    return (f"held-out loss {result['loss']:.4f} accuracy {result['accuracy']:.3f}; greedy on {len(prompts)} eval "
            f"prompts: distinct 4-grams {stats['mean_distinct_4gram_fraction']:.3f}, repeated lines "
            f"{repeated_line_fraction(texts):.3f}")


def train(config: Qwen3Config, stream: np.ndarray, heldout: np.ndarray, tokenizer, probe_prompts: list[dict],
          args) -> Qwen3:
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
            log(f"  probe at step {step}: {probe(model, tokenizer, heldout, probe_prompts, args)}")
    log(f"training took {time.time() - started:.0f}s")
    return model


# ----------------------------------------------------------------------------------------------------------
# Saving and checking the Hugging Face directory


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


# ----------------------------------------------------------------------------------------------------------
# Prompts: code prefixes from held-out files


def cut_points(text: str) -> list[int]:
    """Offsets of line ends (the '\\n' itself) after a non-blank character.

    Cutting just before such a newline is a pre-tokenizer boundary (the newline starts a new whitespace
    piece), so the prompt tokenizes exactly as it does inside the whole file, and the completion starts
    with the newline. Cutting after the newline would split the '\\n    ' indentation piece.
    """
    return [i for i, char in enumerate(text) if char == "\n" and i > 0 and not text[i - 1].isspace()]


def line_starts(text: str) -> list[int]:
    """Offsets where a non-blank line begins."""
    starts, offset = [], 0
    for line in text.split("\n"):
        if line.strip():
            starts.append(offset)
        offset += len(line) + 1
    return starts


def sample_prompts(files: list[tuple[str, str]], tokenizer, count: int, rng: np.random.Generator,
                   min_tokens: int = PROMPT_MIN, max_tokens: int = PROMPT_MAX) -> tuple[list[dict], int]:
    """`count` distinct prompts: text from a random line start to a line end, min..max tokens long.

    Files are drawn in proportion to their length. Returns the prompts and how many draws were rejected.
    """
    weights = np.asarray([len(text) for _, text in files], np.float64)
    cuts = [cut_points(text) for _, text in files]
    starts = [line_starts(text) for _, text in files]
    prompts, seen, rejected = [], set(), 0
    while len(prompts) < count:
        index = int(rng.choice(len(files), p=weights / weights.sum()))
        source, text = files[index]
        ends = cuts[index]
        start = starts[index][int(rng.integers(0, len(starts[index])))]
        wanted = int(rng.integers(min_tokens, max_tokens + 1))
        prompt = None
        for end in ends[np.searchsorted(ends, start):]:  # grow line by line up to `wanted` tokens
            tokens = len(encode(tokenizer, text[start:end]))
            if tokens > max_tokens:
                break
            if tokens >= min_tokens:
                prompt = text[start:end]
            if tokens >= wanted:
                break
        if prompt is None or (source, start) in seen:
            rejected += 1
            continue
        seen.add((source, start))
        prompts.append({"source": source, "prompt": prompt, "ids": encode(tokenizer, prompt),
                        "reference": text[start + len(prompt):][:4000]})
    return prompts, rejected


# ----------------------------------------------------------------------------------------------------------
# Greedy generation with a KV cache, built from the model's own modules


def cached_layer(layer, x, positions, visible, keys, values, write_at, inv_freq):
    """One Qwen3 decoder layer over new tokens x [B, t, H] that also attend to the cached keys/values.

    Same computation as the model's DecoderLayer/Attention, with the new keys/values written into the
    cache ([B, S, kv_heads, head_dim]) at column `write_at` before attending; `visible` [B, t, S] says which
    cache columns each new token sees.
    """
    attn = layer.self_attn
    batch, length, _ = x.shape
    h = layer.input_layernorm(x)
    q = attn.q_norm(attn.q_proj(h).reshape(batch, length, attn.q_heads, attn.head_dim))
    k = attn.k_norm(attn.k_proj(h).reshape(batch, length, attn.kv_heads, attn.head_dim))
    v = attn.v_proj(h).reshape(batch, length, attn.kv_heads, attn.head_dim)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    keys = jax.lax.dynamic_update_slice_in_dim(keys, k.astype(keys.dtype), write_at, axis=1)
    values = jax.lax.dynamic_update_slice_in_dim(values, v.astype(values.dtype), write_at, axis=1)
    out = grouped_attention(q, keys, values, visible, attn.head_dim**-0.5)
    x = x + attn.o_proj(out.reshape(batch, length, attn.q_heads * attn.head_dim))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x, keys, values


def make_decoder(model: Qwen3):
    """decode(ids, write_at, pad, caches) -> (greedy next token [B], caches), jitted, caches updated in place.

    ids [B, t] go to buffer columns write_at.. . The buffer holds each row's left-padded prompt, then the
    generated tokens; row b's first pad[b] columns are padding, which no real token attends to, and its
    positions count from its first real token. caches: per layer a (keys, values) pair [B, S, kv, head_dim].
    """
    graphdef, state = nnx.split(model)
    config = model.config
    inv_freq = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)

    @functools.partial(jax.jit, donate_argnums=(4,))  # donated: the caches are updated in place
    def decode(state, ids, write_at, pad, caches):
        model = nnx.merge(graphdef, state)
        length, size = ids.shape[1], caches[0][0].shape[1]
        columns = write_at + jnp.arange(length)
        positions = jnp.maximum(columns[None, :] - pad[:, None], 0)
        keys = jnp.arange(size)[None, None, :]
        visible = (keys <= columns[None, :, None]) & (keys >= pad[:, None, None])
        visible = visible | (keys == columns[None, :, None])  # a padding query sees itself only
        layers_graphdef, layers_state = nnx.split(model.layers)
        x = model.embed(ids)
        new_caches = []
        for index, (layer_keys, layer_values) in enumerate(caches):  # the stacked layers, one at a time
            layer = nnx.merge(layers_graphdef, jax.tree.map(lambda leaf: leaf[index], layers_state))
            x, layer_keys, layer_values = cached_layer(layer, x, positions, visible, layer_keys, layer_values,
                                                       write_at, inv_freq)
            new_caches.append((layer_keys, layer_values))
        logits = model.logits(model.norm(x[:, -1]))
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), tuple(new_caches)

    return lambda ids, write_at, pad, caches: decode(state, ids, write_at, pad, caches)


def greedy_generate(model: Qwen3, prompts: list[list[int]], new_tokens: int, prompt_len: int,
                    batch: int) -> list[list[int]]:
    """Greedy continuations (new_tokens each, eos not handled here) of prompts no longer than prompt_len."""
    config = model.config
    decode = make_decoder(model)
    cache_shape = (batch, prompt_len + new_tokens, config.num_key_value_heads, config.head_dim)
    results = []
    for first in range(0, len(prompts), batch):
        group = prompts[first:first + batch]
        rows = group + [group[-1]] * (batch - len(group))  # fixed batch shape: one compilation
        pad = jnp.asarray([prompt_len - len(r) for r in rows], jnp.int32)
        buffer = np.zeros((batch, prompt_len), np.int32)
        for row, ids in enumerate(rows):
            buffer[row, prompt_len - len(ids):] = ids
        caches = tuple((jnp.zeros(cache_shape), jnp.zeros(cache_shape)) for _ in range(config.num_hidden_layers))
        token, caches = decode(jnp.asarray(buffer), 0, pad, caches)
        generated = [token]
        for step in range(1, new_tokens):
            token, caches = decode(token[:, None], prompt_len + step - 1, pad, caches)
            generated.append(token)
        generated = np.asarray(jnp.stack(generated, axis=1))
        results.extend(generated[i].tolist() for i in range(len(group)))
    return results


def check_greedy(model: Qwen3, prompt: list[int], generated: list[int], length: int) -> float:
    """Fraction of generated tokens that are the argmax of the plain (uncached) forward of the whole text.

    The text is right-padded to a fixed `length` (one compilation); causal attention ignores the padding.
    """
    ids = np.zeros((1, length), np.int32)
    ids[0, :len(prompt) + len(generated)] = prompt + generated
    predicted = np.asarray(jnp.argmax(forward_logits(model, jnp.asarray(ids))[0], axis=-1))
    return float(np.mean(predicted[len(prompt) - 1:len(prompt) + len(generated) - 1] == np.asarray(generated)))


# ----------------------------------------------------------------------------------------------------------
# Drafter data and diversity statistics


def make_records(prompts: list[dict], generations: list[list[int]], tokenizer) -> tuple[list[dict], dict]:
    """JSONL records (completion cut at <|endoftext|>) and round-trip counts."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    records, counts = [], collections.Counter()
    for prompt, generated in zip(prompts, generations):
        if eos in generated:
            generated = generated[:generated.index(eos)]
            counts["stopped_at_eos"] += 1
        if not generated:
            counts["dropped_empty"] += 1
            continue
        completion = tokenizer.decode(generated)
        counts["exact_roundtrip"] += encode(tokenizer, completion) == generated
        counts["prompt_roundtrip"] += encode(tokenizer, prompt["prompt"]) == prompt["ids"]
        counts["kept"] += 1
        records.append({"prompt": prompt["prompt"], "completion": completion, "source": prompt["source"],
                        "ids": generated, "reference": prompt["reference"]})
    return records, dict(counts)


def diversity(token_lists: list[list[int]]) -> dict:
    """How varied continuations are: distinct tokens / tokens overall, and per continuation the distinct
    token and 4-gram fractions and the share of lines that repeat an earlier line of the same text."""
    all_tokens = [t for ids in token_lists for t in ids]
    per_token, per_4gram = [], []
    for ids in token_lists:
        grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
        per_token.append(len(set(ids)) / max(1, len(ids)))
        if grams:
            per_4gram.append(len(set(grams)) / len(grams))
    return {"distinct_token_ratio": len(set(all_tokens)) / max(1, len(all_tokens)),
            "mean_distinct_token_fraction": float(np.mean(per_token)),
            "mean_distinct_4gram_fraction": float(np.mean(per_4gram)),
            "tokens": len(all_tokens)}


def repeated_line_fraction(texts: list[str]) -> float:
    """Of all non-blank lines, the share that repeat an earlier line of the same continuation."""
    repeats = total = 0
    for text in texts:
        lines = [line.strip() for line in text.split("\n") if line.strip()]
        repeats += len(lines) - len(set(lines))
        total += len(lines)
    return repeats / max(1, total)


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for record in records:
            row = {"prompt": record["prompt"], "completion": record["completion"], "source": record["source"]}
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------------------------
# Report


def directory_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_readme(target_dir: Path, report: dict, command: str) -> None:
    r = report
    lines = [
        "# Toy target: a small Qwen3 model of Python code",
        "",
        "Built by `tools/make_toy_target.py` with this project's own JAX Qwen3 model; do not edit by hand.",
        "",
        "Command (from the repository root):",
        "",
        f"    {command}",
        "",
        f"- Corpus: Python {r['python']} standard library `*.py` files, sorted by path, without test suites, "
        f"`encodings/`, `pydoc_data/` and `site-packages/`: {r['files']['all']} files.",
        f"- Split by name: sha256(relative path) % 100 < {HELDOUT_PERCENT} is held out of LM training "
        f"({r['files']['drafter_train'] + r['files']['drafter_eval']} files); of those, < {EVAL_PERCENT} are "
        f"drafter-eval files ({r['files']['drafter_eval']}), the rest drafter-train files "
        f"({r['files']['drafter_train']}). LM training uses {r['files']['lm']} files, {r['lm_tokens']:,} tokens.",
        f"- Tokenizer: byte-level BPE, {r['tokenizer_size']} tokens incl. `<|endoftext|>` (eos), "
        "`<|im_start|>`, `<|im_end|>`, `<|mask|>` (mask token); ChatML chat template.",
        f"- Model: Qwen3ForCausalLM, hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, "
        f"{MODEL['num_attention_heads']}/{MODEL['num_key_value_heads']} heads x {MODEL['head_dim']}, "
        f"intermediate {MODEL['intermediate_size']}, vocab {r['vocab_size']}, tied embeddings, "
        f"rope theta {MODEL['rope_theta']:g}; {r['parameters']:,} parameters, weights stored as {SAVE_DTYPE}.",
        f"- Training: {r['steps']} steps x {r['batch']} x {r['seq_len']} tokens, AdamW, warmup + cosine, "
        f"peak lr {r['lr']:g}; {r['train_seconds']:.0f} s.",
        "",
        "## Figures",
        "",
        f"- Held-out loss (saved bf16 weights, fp32 compute, {r['heldout']['tokens']:,} tokens of held-out "
        f"files): **{r['heldout']['loss']:.4f} nats/token**, top-1 accuracy {r['heldout']['accuracy']:.3f}. "
        f"LM-train files, same measure: {r['train_eval']['loss']:.4f} nats/token.",
        f"- Eval continuations ({r['diversity_eval']['tokens']} tokens, greedy, {r['new_tokens']} new tokens): "
        f"distinct-token ratio {r['diversity_eval']['distinct_token_ratio']:.3f}; per continuation: distinct "
        f"tokens {r['diversity_eval']['mean_distinct_token_fraction']:.3f}, distinct 4-grams "
        f"{r['diversity_eval']['mean_distinct_4gram_fraction']:.3f}, repeated lines "
        f"{r['repeated_lines_eval']:.3f}.",
        f"- The real file text after the same prompts (same token count): distinct-token ratio "
        f"{r['diversity_reference']['distinct_token_ratio']:.3f}; distinct tokens "
        f"{r['diversity_reference']['mean_distinct_token_fraction']:.3f}, distinct 4-grams "
        f"{r['diversity_reference']['mean_distinct_4gram_fraction']:.3f}, repeated lines "
        f"{r['repeated_lines_reference']:.3f}.",
        f"- Reloaded checks: transformers vs `load_qwen3` max |logit diff| {r['hf_max_abs_diff']:.2e} (fp32); "
        f"KV-cached greedy tokens agreeing with the uncached forward: {r['greedy_agreement']:.4f}.",
        "",
        "## Drafter data (`dflash_jax/assets/toy_data/`)",
        "",
        "`train.jsonl` / `eval.jsonl`: `{\"prompt\", \"completion\", \"source\"}` per line. Prompts are code from "
        "a line start to a line end (before the newline) in held-out files, 64-192 tokens; completions are "
        "this model's greedy continuation, cut at `<|endoftext|>`. Train and eval prompts come from disjoint "
        "files (`source`).",
        "",
    ]
    for name in ("train", "eval"):
        c = r["records"][name]
        lines.append(f"- {name}: {c.get('kept', 0)} records of {c['prompts']} prompts "
                     f"(dropped empty: {c.get('dropped_empty', 0)}, stopped at eos: {c.get('stopped_at_eos', 0)}); "
                     f"completions re-tokenizing to exactly the generated ids: "
                     f"{c.get('exact_roundtrip', 0)}/{c.get('kept', 0)}; prompts re-tokenizing exactly: "
                     f"{c.get('prompt_roundtrip', 0)}/{c.get('kept', 0)}.")
    lines += ["", f"Total time {r['total_seconds']:.0f} s on {r['machine']}. Sizes: toy_target "
              f"{r['sizes']['toy_target'] / 1e6:.2f} MB, toy_data {r['sizes']['toy_data'] / 1e6:.2f} MB.", ""]
    (target_dir / "README.md").write_text("\n".join(lines))


# ----------------------------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    started = time.time()
    target_dir, data_dir = args.assets / "toy_target", args.assets / "toy_data"
    command = "python tools/make_toy_target.py " + " ".join(sys.argv[1:])

    files = stdlib_files()
    if args.quick:  # a slice of the corpus that still has files of every split
        files = files[::8]
    by_split = collections.defaultdict(list)
    for relative, text in files:
        by_split[split_of(relative)].append((relative, text))
    log(f"corpus: {len(files)} files ({sum(len(t) for _, t in files):,} chars) from "
        f"{sysconfig.get_paths()['stdlib']}; " + ", ".join(f"{k}: {len(v)}" for k, v in sorted(by_split.items())))

    tokenizer = train_tokenizer([text for _, text in by_split["lm"]])
    lm_stream = token_stream(tokenizer, [text for _, text in by_split["lm"]])
    heldout_files = by_split["drafter_train"] + by_split["drafter_eval"]
    heldout_stream = token_stream(tokenizer, [text for _, text in heldout_files])
    chars = sum(len(t) for _, t in by_split["lm"])
    log(f"tokenizer: {len(tokenizer)} tokens; LM stream {len(lm_stream):,} tokens "
        f"({chars / len(lm_stream):.2f} chars/token); held-out stream {len(heldout_stream):,} tokens")

    # Prompts depend only on the tokenizer; a few eval prompts also probe the model during training.
    rng = np.random.default_rng(SEED + 1)
    prompts = {}
    for name, split, count in (("train", "drafter_train", args.train_records),
                               ("eval", "drafter_eval", args.eval_records)):
        prompts[name], rejected = sample_prompts(by_split[split], tokenizer, count, rng)
        log(f"{name} prompts: {len(prompts[name])} from {len({p['source'] for p in prompts[name]})} files "
            f"({rejected} draws rejected: too short, too long or repeated)")

    config = model_config(tokenizer)
    trained = train(config, lm_stream, heldout_stream, tokenizer, prompts["eval"][:16], args)
    train_seconds = time.time() - started

    # Everything below uses the bundled (bf16-rounded, reloaded) weights, not the in-memory fp32 ones.
    save_target(trained, tokenizer, target_dir)
    model, loaded_config = load_qwen3(target_dir, param_dtype=jnp.float32)
    assert loaded_config == config, (loaded_config, config)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir)
    hf_diff = check_against_transformers(target_dir, model, tokenizer, heldout_files[0][1][:4000])
    log(f"saved {target_dir}; transformers vs load_qwen3 max |logit diff| {hf_diff:.2e}")
    if hf_diff > 1e-3:
        raise SystemExit(f"transformers and load_qwen3 disagree on the saved model ({hf_diff:.2e})")

    heldout = evaluate(model, heldout_stream, args.seq_len, max_windows=16 if args.quick else 128)
    train_eval = evaluate(model, lm_stream, args.seq_len, max_windows=16 if args.quick else 128)
    log(f"held-out loss {heldout['loss']:.4f} nats/token (accuracy {heldout['accuracy']:.3f}, "
        f"{heldout['tokens']} tokens); LM-train files {train_eval['loss']:.4f}")

    report_records, all_records, greedy_agreement = {}, {}, []
    for name in ("train", "eval"):
        t0 = time.time()
        generations = greedy_generate(model, [p["ids"] for p in prompts[name]], args.new_tokens, PROMPT_MAX,
                                      batch=64)
        log(f"{name}: generated {args.new_tokens} tokens for each of {len(generations)} prompts in "
            f"{time.time() - t0:.0f}s")
        greedy_agreement += [check_greedy(model, p["ids"], g, PROMPT_MAX + args.new_tokens)
                             for p, g in zip(prompts[name][:8], generations[:8])]
        records, counts = make_records(prompts[name], generations, tokenizer)
        counts["prompts"] = len(prompts[name])
        log(f"{name}: {counts}")
        write_jsonl(data_dir / f"{name}.jsonl", records)
        report_records[name], all_records[name] = counts, records
    agreement = float(np.mean(greedy_agreement))
    log(f"KV-cached greedy vs uncached forward argmax agreement: {agreement:.4f}")
    if agreement < 0.99:
        raise SystemExit("the KV-cached generator disagrees with the model's forward")

    eval_records = all_records["eval"]
    references = []
    for record in eval_records:  # the real file text after the prompt, as many tokens as the completion
        reference_ids = encode(tokenizer, record["reference"])[:len(record["ids"])]
        references.append(reference_ids)
    report = {
        "python": platform.python_version(), "machine": f"{platform.machine()}, {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s)",
        "files": {k: len(v) for k, v in by_split.items()} | {"all": len(files)},
        "lm_tokens": len(lm_stream), "tokenizer_size": len(tokenizer), "vocab_size": config.vocab_size,
        "parameters": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
        "train_seconds": train_seconds, "heldout": heldout, "train_eval": train_eval, "new_tokens": args.new_tokens,
        "diversity_eval": diversity([r["ids"] for r in eval_records]),
        "diversity_reference": diversity(references),
        "repeated_lines_eval": repeated_line_fraction([r["completion"] for r in eval_records]),
        "repeated_lines_reference": repeated_line_fraction([tokenizer.decode(ids) for ids in references]),
        "hf_max_abs_diff": hf_diff, "greedy_agreement": agreement, "records": report_records,
    }
    report["total_seconds"] = time.time() - started
    report["sizes"] = {"toy_target": directory_size(target_dir), "toy_data": directory_size(data_dir)}
    write_readme(target_dir, report, command)
    report["sizes"]["toy_target"] = directory_size(target_dir)
    print(json.dumps(report, indent=2, default=float))
    print((target_dir / "README.md").read_text())
    log(f"done in {report['total_seconds']:.0f}s")


if __name__ == "__main__":
    main()

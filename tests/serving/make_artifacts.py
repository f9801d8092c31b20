"""Step 1 of `make test-vllm` (project venv): a target, trained and exported drafters, held-out prompts.

Target and data: the bundled toy target (dflash_jax/assets/toy_target, with toy_data/{train,eval}.jsonl)
when it is present; else a tiny random HF Qwen3 with the test tokenizer, whose drafter data are the
target's own greedy continuations (as in the real recipe) of random word prompts.
Drafters, each trained briefly with the project's CLI (`python -m dflash_jax.train --config configs/tiny.py`)
and exported with convert/export_drafter.py:
  full     all full-attention layers (bidirectional blocks); with the toy target, the `make demo` drafter
           (configs/toy.py as it is), or the finished run of it given as --toy_run (`make test-slow`'s demo
           keeps one, so CI trains it once)
  sliding  a long-context drafter: all sliding-window layers (causal blocks, window W) with YaRN RoPE (factor 4
           over an original window of 128 positions, which the rows and the served prompts pass)
  mixed    sliding + full: exported untrained (no training run), since vLLM 0.32 on CPU refuses it
           (see check_vllm.py)
  dspark   the full drafter's config as an untrained DSpark drafter, for check_vllm_dspark.py, with the
           project's head outputs on random inputs (OUT/dspark_heads.npz)
  dflash2  the full drafter's config as an untrained DFlash2 drafter (convolutions and selector away from their
           initialisation), with the project's outputs of its CPU-runnable parts, for check_vllm_dflash2.py
and a mixture-of-experts group: a tiny random Qwen3-MoE target (8 experts, 2 per token, renormalised), trained
on its own greedy continuations like the random Qwen3 above, with one full-attention drafter.
Writes OUT/artifacts.json for check_vllm*.py: target, drafters {name: {dir, trained}}, dspark, dflash2 (and its
references), block_size, prompts, and "moe" with the MoE group's target, drafters, block_size, prompts and
max_tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import dataclasses
import random
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from dflash_jax.weights.safetensors_dir import read_config  # noqa: E402

TOY_TARGET, TOY_DATA = REPO / "dflash_jax/assets/toy_target", REPO / "dflash_jax/assets/toy_data"
BLOCK_SIZE, WINDOW, TRAIN_STEPS = 8, 32, 150
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
NUM_PROMPTS, NEW_TOKENS = 6, 64
DRAFTERS = {"full": ("full_attention", "full_attention"), "sliding": ("sliding_attention", "sliding_attention"),
            "mixed": ("sliding_attention", "full_attention")}


# The random targets' shape (head_dim 32: vLLM's CPU attention takes 32/64/80/...).
TARGET_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True)


def save_random_target(target: Path, family: str, vocab_size: int) -> None:
    """A random fp32 Qwen3 ("qwen3") or Qwen3-MoE ("qwen3_moe": 8 experts of width 64, 2 per token,
    renormalised) of TARGET_SHAPE, saved by transformers."""
    import torch
    import transformers

    from tests.hf_fixtures import qwen3_config, randomize_parameters, save_qwen3

    if family == "qwen3":
        save_qwen3(target, qwen3_config(vocab_size=vocab_size, **TARGET_SHAPE), seed=0)
        return
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=vocab_size, moe_intermediate_size=64, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True,
                                         **TARGET_SHAPE)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    randomize_parameters(model, seed=0).save_pretrained(target)


def random_target_and_data(target: Path, family: str) -> tuple[Path, Path, list[list[int]]]:
    """A random target of `family` (save_random_target) + tokenizer in `target`, its greedy continuations of 300
    word prompts as training records (target/../<family>_train.jsonl), and 6 held-out prompts (token ids)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.tokenizer_fixture import _WORDS, make_chat_tokenizer

    tokenizer = make_chat_tokenizer()
    save_random_target(target, family, vocab_size=len(tokenizer) + 8)
    tokenizer.save_pretrained(target)
    tokenizer, model = AutoTokenizer.from_pretrained(target), AutoModelForCausalLM.from_pretrained(target).eval()
    rng = random.Random(0)
    prompts = [tokenizer(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 16))))["input_ids"]
               for _ in range(300 + NUM_PROMPTS)]
    # One batched greedy generate over the left-padded prompts (the 8 spare vocabulary rows have no text).
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts[NUM_PROMPTS:]])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts[NUM_PROMPTS:]])
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                   pad_token_id=0)[:, width:].tolist()
    train_file = target.parent / f"{family}_train.jsonl"
    with open(train_file, "w") as f:
        for prompt, continuation in zip(prompts[NUM_PROMPTS:], generated):
            completion = tokenizer.decode([i for i in continuation if i < len(tokenizer)])
            f.write(json.dumps({"prompt": tokenizer.decode(prompt), "completion": completion}) + "\n")
    return target, train_file, prompts[:NUM_PROMPTS]


def toy_target_and_data() -> tuple[Path, Path, list[list[int]]]:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(TOY_TARGET)
    records = [json.loads(line) for line in (TOY_DATA / "eval.jsonl").read_text().splitlines()[:NUM_PROMPTS]]
    prompts = [tokenizer(record["prompt"], add_special_tokens=False)["input_ids"] for record in records]
    return TOY_TARGET, TOY_DATA / "train.jsonl", prompts


def tiny_overrides(name: str, target: Path, train_file: Path, steps: int, seq_len: int) -> dict:
    """configs/tiny.py overrides for this drafter's layer types, rows of seq_len tokens."""
    layers = read_config(target)["num_hidden_layers"]
    # Distinct, increasing feature layers: vLLM captures sorted(set(ids)) (configs/tiny.py's default of two
    # feature layers would repeat layer 1 on a 4-layer target).
    feature_ids = (0, layers // 2 - 1, layers - 2)
    return {
        "target_dir": str(target), "data.train_files": f"('{train_file}',)", "total_steps": steps,
        "checkpoint_every": steps, "log_every": 50, "data.seq_len": seq_len, "optim.learning_rate": 3e-3,
        "drafter.block_size": BLOCK_SIZE, "mesh.fsdp": 1, "drafter.head_dim": 32, "drafter.layer_types": repr(DRAFTERS[name]),
        "drafter.sliding_window": WINDOW, "drafter.num_feature_layers": len(feature_ids),
        "drafter.target_layer_ids": repr(feature_ids),
    }


def train_and_export(name: str, config_file: Path, overrides: dict, out: Path) -> Path:
    """`python -m dflash_jax.train --config config_file` with the overrides, then the export CLI."""
    workdir = out / f"run_{name}"
    shutil.rmtree(workdir, ignore_errors=True)  # train afresh (an existing workdir would be resumed)
    subprocess.run([sys.executable, "-m", "dflash_jax.train", "--config", str(config_file),
                    "--workdir", str(workdir), *(f"--config.{key}={value}" for key, value in overrides.items())],
                   check=True, cwd=REPO)
    return export(workdir, out / f"drafter_{name}")


def export(workdir: Path, export_dir: Path) -> Path:
    subprocess.run([sys.executable, str(REPO / "convert/export_drafter.py"), "--workdir", str(workdir), "--out",
                    str(export_dir), "--overwrite"], check=True, cwd=REPO)
    return export_dir


def export_untrained_mixed(full_run: Path, out: Path) -> Path:
    """The "full" run's drafter config with [sliding, full] layers, randomly initialised and exported."""
    from flax import nnx

    from dflash_jax.models.drafter import Drafter, DrafterConfig
    from dflash_jax.weights.drafter_files import export_drafter
    full = DrafterConfig(**json.loads((full_run / "drafter_config.json").read_text()))
    config = dataclasses.replace(full, layer_types=DRAFTERS["mixed"], sliding_window=WINDOW)
    return export_drafter(Drafter(config, rngs=nnx.Rngs(0)), config, out / "drafter_mixed", overwrite=True)


def export_untrained_dspark(full_run: Path, target: Path, out: Path) -> Path:
    """The "full" run's drafter config as a DSpark drafter (Markov rank 8), randomly initialised (W1 scaled so that
    the Markov bias is on the logits' scale) and exported, and OUT/dspark_heads.npz: random final hidden states
    and previous tokens, the target's LM head, and the project's Markov-corrected logits and confidence logits of
    them from the exported weights. vLLM on CPU can only parse the drafter, load it and run its heads
    (check_vllm_dspark.py)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dflash_jax.models.drafter import Drafter, DrafterConfig
    from dflash_jax.ops.lm_head import fp32_logits
    from dflash_jax.weights.drafter_files import export_drafter, load_drafter_dir
    from dflash_jax.weights.targets import load_target
    full = DrafterConfig(**json.loads((full_run / "drafter_config.json").read_text()))
    config = dataclasses.replace(full, method="dspark", markov_rank=8)
    drafter = Drafter(config, rngs=nnx.Rngs(0))
    drafter.markov_head.w1.set_value(drafter.markov_head.w1[...] * 100)
    export_dir = export_drafter(drafter, config, out / "drafter_dspark", overwrite=True)
    exported, _ = load_drafter_dir(export_dir)  # the bf16 weights on disk, as vLLM reads them
    lm_head = load_target(target, param_dtype=jnp.float32)[0].lm_head_kernel()
    keys = jax.random.split(jax.random.key(0))
    hidden = jax.random.normal(keys[0], (16, config.hidden_size), jnp.float32)
    previous = jax.random.randint(keys[1], (16,), 0, config.vocab_size)
    head = exported.markov_head
    logits = fp32_logits(hidden, lm_head) + head.logit_bias(previous, jnp.float32)
    confidence = exported.confidence_head(hidden, head.prev_embeddings(previous))
    np.savez(out / "dspark_heads.npz", hidden=np.asarray(hidden), previous=np.asarray(previous),
             lm_head=np.asarray(lm_head).T, logits=np.asarray(logits), confidence=np.asarray(confidence))
    return export_dir


def moe_group(out: Path, steps: int) -> dict:
    """The mixture-of-experts group: its random target and data, and one full-attention drafter trained on them."""
    target, train_file, prompts = random_target_and_data(out / "target_moe", "qwen3_moe")
    overrides = tiny_overrides("full", target, train_file, steps, seq_len=128)
    drafter = train_and_export("moe", REPO / "configs/tiny.py", overrides, out)
    return {"target": str(target), "drafters": {"moe": {"dir": str(drafter), "trained": True}},
            "block_size": BLOCK_SIZE, "prompts": prompts, "max_tokens": NEW_TOKENS}


def export_dflash2_and_references(full_run: Path, out: Path) -> tuple[Path, Path]:
    """The "full" run's drafter config as a DFlash2 drafter, its convolutions and selector moved away from their
    initialisation, exported; and what the project computes, with the weights read back from that export (bf16),
    for the parts of vLLM's model that run on CPU outside its engine (check_vllm_dflash2.py): every block
    convolution around an identity sublayer on random rows of two blocks, and the selector's scores of every
    (previous candidate, candidate) edge and its greedy walk on random hidden states and unary logits."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dflash_jax.models.drafter import Drafter, DrafterConfig
    from dflash_jax.weights.drafter_files import export_drafter, load_drafter_dir
    full = DrafterConfig(**json.loads((full_run / "drafter_config.json").read_text()))
    config = dataclasses.replace(full, method="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=32,
                                 selector_top_k=6)
    drafter = Drafter(config, rngs=nnx.Rngs(0))
    keys = iter(jax.random.split(jax.random.key(0), 4 * config.num_hidden_layers))
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            base = conv.base_kernel
            base.set_value(base[...] + 0.3 * jax.random.normal(next(keys), base.shape))
            projection = conv.kernel_projection.kernel
            projection.set_value(0.1 * jax.random.normal(next(keys), projection.shape))
    for codebook in (drafter.candidate_selector.predecessor_codebook, drafter.candidate_selector.successor_codebook):
        codebook.set_value(codebook[...] * 30)
    export_dir = export_drafter(drafter, config, out / "drafter_dflash2", overwrite=True)

    drafter, _ = load_drafter_dir(export_dir)
    rng = np.random.default_rng(0)
    block, hidden_size, top_k = config.block_size, config.hidden_size, config.selector_top_k
    references = {}
    for index, layer in enumerate(drafter.layers):
        for name in ("attention_conv", "mlp_conv"):
            x = rng.standard_normal((2 * block, hidden_size)).astype(np.float32)
            references[f"layers.{index}.{name}/x"] = x
            references[f"layers.{index}.{name}/out"] = np.asarray(getattr(layer, name).around(lambda y: y, x[None])[0])
    selector = drafter.candidate_selector
    hidden = rng.standard_normal((2, block - 1, hidden_size)).astype(np.float32)
    logits = (3 * rng.standard_normal((2, block - 1, config.vocab_size))).astype(np.float32)
    anchors = rng.integers(0, config.vocab_size, 2)
    unary, candidates = jax.lax.top_k(jnp.asarray(logits), top_k)
    # Edge (l, j, c): candidate c of slot l after candidate j of slot l - 1 (after the anchor for slot 0).
    previous = jnp.concatenate([jnp.broadcast_to(jnp.asarray(anchors)[:, None, None], (2, 1, top_k)),
                                candidates[:, :-1]], axis=1)
    edges = selector.scores(jnp.broadcast_to(jnp.asarray(hidden)[:, :, None], (2, block - 1, top_k, hidden_size)),
                            previous, jnp.broadcast_to(candidates[:, :, None], (2, block - 1, top_k, top_k)),
                            jnp.broadcast_to(unary[:, :, None], (2, block - 1, top_k, top_k)))
    walk = selector.greedy_walk(jnp.asarray(hidden), jax.nn.log_softmax(jnp.asarray(logits), axis=-1),
                                jnp.asarray(anchors))
    references.update({"selector/hidden": hidden, "selector/logits": logits, "selector/anchors": anchors,
                       "selector/candidate_ids": np.asarray(candidates), "selector/edge_scores": np.asarray(edges),
                       "selector/walk": np.asarray(walk)})
    np.savez(out / "dflash2_references.npz", **references)
    return export_dir, out / "dflash2_references.npz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=TRAIN_STEPS, help="training steps per drafter")
    parser.add_argument("--toy_run", type=Path, help="a finished `configs/toy.py` training workdir to export as "
                        "the full drafter instead of training it again")
    args = parser.parse_args()
    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    toy = (TOY_TARGET / "config.json").is_file() and (TOY_DATA / "train.jsonl").is_file()
    target, train_file, prompts = toy_target_and_data() if toy else random_target_and_data(out / "target", "qwen3")
    seq_len = 512 if toy else 128  # a toy record (prompt <= 192 + completion <= 128) fits one row
    runs = {name: (REPO / "configs/tiny.py", tiny_overrides(name, target, train_file, args.steps, seq_len))
            for name in ("full", "sliding")}
    runs["sliding"][1]["drafter.rope_scaling"] = json.dumps(YARN)
    full_run = out / "run_full"
    if toy:  # the full-attention drafter is exactly the one `make demo` trains and exports
        runs["full"] = (REPO / "configs/toy.py", {"mesh.fsdp": 1})
        if args.toy_run:
            full_run = args.toy_run.absolute()
            del runs["full"]
    drafters = {name: {"dir": str(train_and_export(name, config_file, overrides, out)), "trained": True}
                for name, (config_file, overrides) in runs.items()}
    if "full" not in drafters:
        drafters["full"] = {"dir": str(export(full_run, out / "drafter_full")), "trained": True}
    drafters["mixed"] = {"dir": str(export_untrained_mixed(full_run, out)), "trained": False}
    dflash2, dflash2_references = export_dflash2_and_references(full_run, out)
    artifacts = {"target": str(target), "drafters": drafters,
                 "dspark": str(export_untrained_dspark(full_run, target, out)),
                 "dflash2": str(dflash2), "dflash2_references": str(dflash2_references),
                 "block_size": BLOCK_SIZE, "prompts": prompts, "max_tokens": NEW_TOKENS,
                 "moe": moe_group(out, args.steps)}
    (out / "artifacts.json").write_text(json.dumps(artifacts, indent=2) + "\n")
    print(f"wrote {out / 'artifacts.json'} (target {target}, drafters {sorted(drafters)})")


if __name__ == "__main__":
    main()

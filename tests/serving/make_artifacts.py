"""Step 1 of `make test-vllm` (project venv): a target, trained and exported drafters, held-out prompts.

Target and data: the bundled toy target (dflash_jax/assets/toy_target, with toy_data/{train,eval}.jsonl)
when it is present; else a tiny random HF Qwen3 with the test tokenizer, whose drafter data are the
target's own greedy continuations (as in the real recipe) of random word prompts.
Drafters, each trained briefly with the project's CLI (`python -m dflash_jax.train --config configs/tiny.py`)
and exported with convert/export_drafter.py:
  full     all full-attention layers (bidirectional blocks); with the toy target, the `make demo` drafter
           (configs/toy.py as it is), or the finished run of it given as --toy_run (`make test-slow`'s demo
           keeps one, so CI trains it once)
  sliding  all sliding-window layers (causal blocks, window W)
  mixed    sliding + full: exported untrained (no training run), since vLLM 0.32 on CPU refuses it
           (see check_vllm.py)
  dspark   the full drafter's config as an untrained DSpark drafter, for check_vllm_dspark.py, with the
           project's head outputs on random inputs (OUT/dspark_heads.npz)
Writes OUT/artifacts.json for check_vllm.py: target, drafters {name: {dir, trained}}, dspark, block_size, prompts.
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
BLOCK_SIZE, WINDOW, TRAIN_STEPS = 8, 32, 300
NUM_PROMPTS, NEW_TOKENS = 6, 64
DRAFTERS = {"full": ("full_attention", "full_attention"), "sliding": ("sliding_attention", "sliding_attention"),
            "mixed": ("sliding_attention", "full_attention")}


def random_target_and_data(out: Path) -> tuple[Path, Path, list[list[int]]]:
    """A random Qwen3 (head_dim 32: vLLM's CPU attention takes 32/64/80/...) + tokenizer, its greedy
    continuations of 300 word prompts as training records, and 6 held-out prompts (token ids)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.hf_fixtures import qwen3_config, save_qwen3
    from tests.tokenizer_fixture import _WORDS, make_chat_tokenizer

    target = out / "target"
    tokenizer = make_chat_tokenizer()
    save_qwen3(target, qwen3_config(vocab_size=len(tokenizer) + 8, hidden_size=128, intermediate_size=256,
                                    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    max_position_embeddings=1024, tie_word_embeddings=True), seed=0)
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
    train_file = out / "train.jsonl"
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
    target, train_file, prompts = toy_target_and_data() if toy else random_target_and_data(out)
    seq_len = 512 if toy else 128  # a toy record (prompt <= 192 + completion <= 128) fits one row
    runs = {name: (REPO / "configs/tiny.py", tiny_overrides(name, target, train_file, args.steps, seq_len))
            for name in ("full", "sliding")}
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
    dspark = export_untrained_dspark(full_run, target, out)
    artifacts = {"target": str(target), "drafters": drafters, "dspark": str(dspark),
                 "block_size": BLOCK_SIZE, "prompts": prompts,
                 "max_tokens": NEW_TOKENS}
    (out / "artifacts.json").write_text(json.dumps(artifacts, indent=2) + "\n")
    print(f"wrote {out / 'artifacts.json'} (target {target}, drafters {sorted(drafters)})")


if __name__ == "__main__":
    main()

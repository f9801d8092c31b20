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
   continuations (the project's KV-cached generator).
6. Report the held-out loss and how varied the continuations are: toy_target/build.json and README.md.

Run (from the repository root; about an hour on 2 CPU cores):
    .venv/bin/python tools/make_toy_target.py
Only steps 4-6 again, from the saved target (about 10 minutes):
    .venv/bin/python tools/make_toy_target.py --data-only
Smoke run (a minute or two; writes under /tmp/dflash_toy_quick unless --assets is given):
    .venv/bin/python tools/make_toy_target.py --quick
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from dflash_jax.weights.hf_qwen3 import load_qwen3  # noqa: E402
from tools.toy_target import corpus, drafter_data, language_model  # noqa: E402
from tools.toy_target.language_model import log  # noqa: E402
from tools.toy_target.readme import write_readme  # noqa: E402

SEED = 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 1500; --quick: 20)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=512,
                        help="tokens per training sequence (covers the 192 + 128 of prompt + completion)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--probe-every", type=int, default=250, help="steps between held-out/greedy probes")
    parser.add_argument("--train-records", type=int, default=None, help="drafter train records (default 1536)")
    parser.add_argument("--eval-records", type=int, default=None, help="drafter eval records (default 64)")
    parser.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per completion (default 128)")
    parser.add_argument("--assets", type=Path, default=None,
                        help="output root holding toy_target/ and toy_data/ (default dflash_jax/assets; "
                             "--quick: /tmp/dflash_toy_quick)")
    parser.add_argument("--data-only", action="store_true",
                        help="keep the saved toy_target (no training); rewrite the data, build.json and README")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny corpus, few steps, few records")
    args = parser.parse_args()
    quick = args.quick
    args.steps = args.steps or (20 if quick else 1500)
    args.train_records = args.train_records or (16 if quick else 1536)
    args.eval_records = args.eval_records or (8 if quick else 64)
    args.new_tokens = args.new_tokens or (16 if quick else 128)
    args.assets = args.assets or (Path("/tmp/dflash_toy_quick") if quick else REPO / "dflash_jax" / "assets")
    return args


def probe_fn(tokenizer, heldout: np.ndarray, prompts: list[dict], args):
    """probe(model): held-out loss on a few windows and how varied greedy continuations of a few prompts are."""
    eos = tokenizer.convert_tokens_to_ids(corpus.EOS)

    def probe(model) -> str:
        result = language_model.evaluate(model, heldout, args.seq_len, max_windows=16)
        generations = drafter_data.greedy_continuations(model, [p["ids"] for p in prompts], args.new_tokens, eos)
        stats = drafter_data.diversity(generations)
        texts = [tokenizer.decode(ids) for ids in generations]
        return (f"held-out loss {result['loss']:.4f} accuracy {result['accuracy']:.3f}; greedy on {len(prompts)} "
                f"eval prompts: distinct 4-grams {stats['mean_distinct_4gram_fraction']:.3f}, repeated lines "
                f"{drafter_data.repeated_line_fraction(texts):.3f}")

    return probe


def directory_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    args = parse_args()
    target_dir, data_dir = args.assets / "toy_target", args.assets / "toy_data"

    files = corpus.stdlib_files()
    if args.quick:  # a slice of the corpus that still has files of every split
        files = files[::8]
    by_split = collections.defaultdict(list)
    for relative, text in files:
        by_split[corpus.split_of(relative)].append((relative, text))
    log(f"corpus: {len(files)} files ({sum(len(t) for _, t in files):,} chars) from {corpus.stdlib_root()}; "
        + ", ".join(f"{k}: {len(v)}" for k, v in sorted(by_split.items())))

    if args.data_only:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir)
        training = json.loads((target_dir / "build.json").read_text())["training"]
    else:
        tokenizer = corpus.train_tokenizer([text for _, text in by_split["lm"]])
    lm_stream = corpus.token_stream(tokenizer, [text for _, text in by_split["lm"]])
    heldout_files = by_split["drafter_train"] + by_split["drafter_eval"]
    heldout_stream = corpus.token_stream(tokenizer, [text for _, text in heldout_files])
    chars = sum(len(t) for _, t in by_split["lm"])
    log(f"tokenizer: {len(tokenizer)} tokens; LM stream {len(lm_stream):,} tokens "
        f"({chars / len(lm_stream):.2f} chars/token); held-out stream {len(heldout_stream):,} tokens")

    # Prompts depend only on the tokenizer; a few eval prompts also probe the model during training.
    rng = np.random.default_rng(SEED + 1)
    prompts = {}
    for name, split, count in (("train", "drafter_train", args.train_records),
                               ("eval", "drafter_eval", args.eval_records)):
        prompts[name], rejected = drafter_data.sample_prompts(by_split[split], tokenizer, count, rng)
        log(f"{name} prompts: {len(prompts[name])} from {len({p['source'] for p in prompts[name]})} files "
            f"({rejected} draws rejected: too short, too long or repeated)")

    config = language_model.model_config(tokenizer)
    if not args.data_only:
        started = time.time()
        probe = probe_fn(tokenizer, heldout_stream, prompts["eval"][:8], args)
        trained = language_model.train(config, lm_stream, args, probe)
        training = {"steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
                    "seconds": time.time() - started, "machine": f"{platform.machine()}, {jax.device_count()} "
                    f"{jax.devices()[0].platform} device(s)"}
        language_model.save_target(trained, tokenizer, target_dir)

    # Everything below uses the bundled (bf16-rounded, reloaded) weights, not the in-memory fp32 ones.
    model, loaded_config = load_qwen3(target_dir, param_dtype=jnp.float32)
    if loaded_config != config:
        raise SystemExit(f"the saved config differs from the tokenizer's: {loaded_config} vs {config}")
    if not args.data_only:  # the tokenizer as saved; --data-only loaded it from there already
        tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir)
    hf_diff = language_model.check_against_transformers(target_dir, model, tokenizer, heldout_files[0][1][:4000])
    log(f"{target_dir}: transformers vs load_qwen3 max |logit diff| {hf_diff:.2e}")
    if hf_diff > 1e-3:
        raise SystemExit(f"transformers and load_qwen3 disagree on the saved model ({hf_diff:.2e})")

    windows = 16 if args.quick else 128
    heldout = language_model.evaluate(model, heldout_stream, args.seq_len, max_windows=windows)
    train_eval = language_model.evaluate(model, lm_stream, args.seq_len, max_windows=windows)
    log(f"held-out loss {heldout['loss']:.4f} nats/token (accuracy {heldout['accuracy']:.3f}, "
        f"{heldout['tokens']} tokens); LM-train files {train_eval['loss']:.4f}")

    started = time.time()
    eos = tokenizer.convert_tokens_to_ids(corpus.EOS)
    everything = prompts["train"] + prompts["eval"]  # one generation pass: one compile
    generations = drafter_data.greedy_continuations(model, [p["ids"] for p in everything], args.new_tokens, eos)
    log(f"generated up to {args.new_tokens} tokens for each of {len(everything)} prompts in "
        f"{time.time() - started:.0f}s")
    generated = {"train": generations[:len(prompts["train"])], "eval": generations[len(prompts["train"]):]}
    report_records, all_records = {}, {}
    for name in ("train", "eval"):
        records, counts = drafter_data.make_records(prompts[name], generated[name], tokenizer)
        counts["prompts"] = len(prompts[name])
        log(f"{name}: {counts}")
        drafter_data.write_jsonl(data_dir / f"{name}.jsonl", records)
        report_records[name], all_records[name] = counts, records

    eval_records = all_records["eval"]
    # The real file text after each eval prompt, as many tokens as the model's completion.
    references = [corpus.encode(tokenizer, r["reference"])[:len(r["ids"])] for r in eval_records]
    report = {
        "command": "python tools/make_toy_target.py" + "".join(f" {a}" for a in sys.argv[1:] if a != "--data-only"),
        "python": platform.python_version(), "training": training,
        "files": {k: len(v) for k, v in by_split.items()} | {"all": len(files)},
        "lm_tokens": len(lm_stream), "tokenizer_size": len(tokenizer), "vocab_size": config.vocab_size,
        "parameters": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        "heldout": heldout, "train_eval": train_eval, "new_tokens": args.new_tokens,
        "diversity_eval": drafter_data.diversity([r["ids"] for r in eval_records]),
        "diversity_reference": drafter_data.diversity(references),
        "repeated_lines_eval": drafter_data.repeated_line_fraction([r["completion"] for r in eval_records]),
        "repeated_lines_reference": drafter_data.repeated_line_fraction([tokenizer.decode(i) for i in references]),
        "hf_max_abs_diff": hf_diff, "records": report_records, "data_seconds": time.time() - started,
    }
    (target_dir / "build.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    report["sizes"] = {"toy_target": directory_size(target_dir), "toy_data": directory_size(data_dir)}
    write_readme(target_dir, report)
    print((target_dir / "README.md").read_text())
    log("done")


if __name__ == "__main__":
    main()

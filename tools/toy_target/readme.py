"""The toy target's README.md, written from the build report (every figure in it is measured)."""

from __future__ import annotations

from pathlib import Path

from tools.toy_target.corpus import EVAL_PERCENT, HELDOUT_PERCENT
from tools.toy_target.drafter_data import PROMPT_MAX, PROMPT_MIN
from tools.toy_target.language_model import MODEL, SAVE_DTYPE


def write_readme(target_dir: Path, report: dict) -> None:
    r, t = report, report["training"]
    lines = [
        "# Toy target: a small Qwen3 model of Python code",
        "",
        "Built by `tools/make_toy_target.py` with this project's own JAX Qwen3 model; do not edit by hand.",
        "Every figure below is also in `build.json`. Command (from the repository root):",
        "",
        f"    {r['command']}",
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
        f"- Training: {t['steps']} steps x {t['batch']} x {t['seq_len']} tokens, AdamW, warmup + cosine, "
        f"peak lr {t['lr']:g}; {t['seconds']:.0f} s on {t['machine']}.",
        "",
        "## Figures",
        "",
        f"- Held-out loss (saved bf16 weights, fp32 compute, {r['heldout']['tokens']:,} tokens of held-out "
        f"files): **{r['heldout']['loss']:.4f} nats/token**, top-1 accuracy {r['heldout']['accuracy']:.3f}. "
        f"LM-train files, same measure: {r['train_eval']['loss']:.4f} nats/token.",
        f"- Eval continuations ({r['diversity_eval']['tokens']} tokens, greedy, at most {r['new_tokens']} new "
        f"tokens): **distinct-token ratio {r['diversity_eval']['distinct_token_ratio']:.3f}**; per continuation: "
        f"distinct tokens {r['diversity_eval']['mean_distinct_token_fraction']:.3f}, distinct 4-grams "
        f"{r['diversity_eval']['mean_distinct_4gram_fraction']:.3f}, repeated lines {r['repeated_lines_eval']:.3f}.",
        f"- The real file text after the same prompts (same token count): distinct-token ratio "
        f"{r['diversity_reference']['distinct_token_ratio']:.3f}; distinct tokens "
        f"{r['diversity_reference']['mean_distinct_token_fraction']:.3f}, distinct 4-grams "
        f"{r['diversity_reference']['mean_distinct_4gram_fraction']:.3f}, repeated lines "
        f"{r['repeated_lines_reference']:.3f}.",
        f"- transformers vs `load_target` on the saved files: max |logit diff| {r['hf_max_abs_diff']:.2e} (fp32).",
        "",
        "## Drafter data (`dflash_jax/assets/toy_data/`)",
        "",
        "`train.jsonl` / `eval.jsonl`: `{\"prompt\", \"completion\", \"source\"}` per line. Prompts are code from "
        f"a line start to a line end (before the newline) in held-out files, {PROMPT_MIN}-{PROMPT_MAX} tokens; "
        "completions are this model's greedy continuation (the project's regeneration code, "
        "`python -m dflash_jax.regenerate`), cut at `<|endoftext|>`. Train and eval prompts come from disjoint "
        "files (`source`).",
        "",
    ]
    for name in ("train", "eval"):
        c = r["records"][name]
        lines.append(f"- {name}: {c['kept']} records of {c['prompts']} prompts (dropped empty: "
                     f"{c['dropped_empty']}, cut at the token limit rather than at eos: {c['cut_at_max_tokens']}); "
                     f"prompts re-tokenizing exactly: {c['prompt_roundtrip']}/{c['prompts']}.")
    lines += ["", f"Data generation took {r['data_seconds']:.0f} s. Sizes: toy_target "
              f"{r['sizes']['toy_target'] / 1e6:.2f} MB, toy_data {r['sizes']['toy_data'] / 1e6:.2f} MB.", ""]
    (target_dir / "README.md").write_text("\n".join(lines))

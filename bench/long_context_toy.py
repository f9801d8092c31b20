"""Short rows against long rows on the toy target: τ by context length (design §9.7, bench/RESULTS.md
"Long context on the toy target").

The toy target reads Python files; what it writes next depends on names defined hundreds or thousands of tokens
earlier (imports, functions, attributes), as an agent's next lines depend on a file it read. Four drafters:

- short: the demo's recipe (configs/toy.py: 328-token rows of 64-192-token prompts and their 128-token
  continuations), its run reused with --short_run;
- short + S: that drafter trained S more steps on the same short rows, at a tenth of the demo's rates (the
  control: as many more updates);
- long documents + S: that drafter trained S more steps, at the same rates, on long rows (2,048 tokens): one
  document a row, 1,500-2,000 tokens of a drafter-train file, trained on every position past its first line.
  The labels are the target's own greedy tokens (config.loss.labels = "target"), so raw files serve as well as
  regenerated ones, and anchors spread over the whole row train the drafter at every context length up to 2,048;
- long mixed + S: the same, its long rows drawn from the documents and from the demo's short records packed
  several to a row (each source once an epoch), the recipe a long-context run would use.

Each is evaluated on the same long records from the drafter-eval files (the demo's held-out split): prompts of
64-2,000 tokens, `--eval_per_bin` in each of the bins 0-256, 256-512, 512-1K and 1K+, with the target's greedy
64-token continuations; exact τ (B = 8) per bin (`dflash-jax evaluate --context_bins`). Run from the repository
root (about 20 minutes on 2 CPU cores with the demo's run reused, 8 more without):

    make long-context-toy SHORT_RUN=out/toy_run   # bench.long_context_toy --out out/long_toy --short_run ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TOY = str(REPO / "configs" / "toy.py")
CLI = [str(Path(sys.executable).with_name("dflash-jax"))]  # the venv's console script
LONG_ROW = 2048  # the toy target's max_position_embeddings
NEW_TOKENS = 64  # continuation tokens of an evaluation record
EDGES = ("256", "512", "1K")  # bins 0-256, 256-512, 512-1K, 1K+
PROMPT_RANGES = ((64, 255), (256, 511), (512, 1023), (1024, LONG_ROW - NEW_TOKENS - 8))  # eval prompts per bin
DOCUMENT_TOKENS = (1500, LONG_ROW - 8)  # a long training row's document
# The continuations' rates: a tenth of the demo's (3e-3, Muon's matrices 3e-2), so that S steps adapt the
# trained drafter instead of restarting its schedule at full rate.
SHORT_RECORDS = REPO / "dflash_jax" / "assets" / "toy_data" / "train.jsonl"  # the demo's rows
RATES = ("--config.optim.learning_rate=3e-4", "--config.optim.muon_learning_rate=3e-3")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def command(*args: str) -> None:
    log("$ dflash-jax " + " ".join(args))
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, as `make demo`
    subprocess.run([*CLI, *args], cwd=REPO, env=env, check=True)


def write_long_records(out: Path, train_records: int, eval_per_bin: int, seed: int) -> tuple[Path, Path]:
    """Documents for the long rows, and evaluation records through the toy target's own data code
    (tools/toy_target): prompts cut at line ends from the drafter-eval files, the target's greedy continuations
    as completions."""
    train, evaluation = out / "train_documents.jsonl", out / "eval_long.jsonl"
    if train.exists() and evaluation.exists():
        log(f"long records: reusing {train} and {evaluation}")
        return train, evaluation
    sys.path.insert(0, str(REPO))
    import jax.numpy as jnp
    from transformers import AutoTokenizer

    from dflash_jax.weights.targets import load_target
    from tools.toy_target import corpus, drafter_data

    target_dir = REPO / "dflash_jax" / "assets" / "toy_target"
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    files = {"drafter_train": [], "drafter_eval": []}
    for relative, text in corpus.stdlib_files():
        files.get(corpus.split_of(relative), []).append((relative, text))
    rng = np.random.default_rng(seed)
    started = time.monotonic()
    documents, _ = drafter_data.sample_prompts(files["drafter_train"], tokenizer, train_records, rng,
                                               *DOCUMENT_TOKENS)
    lines = []
    for document in documents:  # its first line the prompt, the rest trained (a cut at a line end, as the toy's)
        first = drafter_data.cut_points(document["prompt"])[0]
        lines.append(json.dumps({"prompt": document["prompt"][:first], "completion": document["prompt"][first:],
                                 "source": document["source"]}) + "\n")
    train.write_text("".join(lines))
    log(f"{len(lines)} long training documents ({time.monotonic() - started:.0f} s)")
    model, _ = load_target(target_dir, param_dtype=jnp.float32)
    eos = tokenizer.convert_tokens_to_ids(corpus.EOS)
    prompts = []
    for low, high in PROMPT_RANGES:
        prompts += drafter_data.sample_prompts(files["drafter_eval"], tokenizer, eval_per_bin, rng, low, high)[0]
    counts = drafter_data.write_regenerated(model, tokenizer, prompts, NEW_TOKENS, eos, evaluation)
    log(f"long eval records: {counts} ({time.monotonic() - started:.0f} s)")
    return train, evaluation


def train_on(workdir: Path, init_from: Path, steps: int, *overrides: str) -> Path:
    """`steps` more steps from the exported drafter `init_from` at RATES; returns its export."""
    exported = workdir.with_name(workdir.name + "_drafter")
    if not (exported / "config.json").exists():
        command("train", "--config", TOY, "--workdir", str(workdir), f"--config.drafter.init_from={init_from}",
                f"--config.total_steps={steps}", "--config.checkpoint_every=1000000", *RATES, *overrides)
        command("export", "--workdir", str(workdir), "--out", str(exported))
    return exported


def evaluate(drafter: Path, prompts: Path, out: Path) -> dict:
    if not out.exists():
        command("evaluate", "--config", TOY, "--drafter", str(drafter), "--prompts", str(prompts),
                "--num_prompts", "100000", "--continuation", "data", "--max_new_tokens", str(NEW_TOKENS),
                "--budgets", "8",
                "--context_bins", ",".join(EDGES), "--json", str(out))
    return json.loads(out.read_text())["trained"]


def table(results: dict[str, dict]) -> str:
    """Markdown: exact τ per context bin for each drafter, pooled (per-response mean in brackets), and the
    bin's count of responses."""
    bins = [entry["bin"] for entry in next(iter(results.values()))["by_context"]]
    lines = ["| prompt tokens | responses | " + " | ".join(f"τ {name}" for name in results) + " |",
             "|---" * (len(results) + 2) + "|"]
    for index, label in enumerate(bins + ["all"]):
        entries = [result["by_context"][index] if label != "all" else result for result in results.values()]
        cells = [f"{entry['tau']:.3f} ({entry['tau_per_response']:.3f})" for entry in entries]
        lines.append(f"| {label} | {entries[0]['responses']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "out" / "long_toy")
    parser.add_argument("--short_run", type=Path, default=None,
                        help="a finished configs/toy.py workdir (make demo's out/toy_run); trained here if not given")
    parser.add_argument("--steps", type=int, default=300, help="extra steps of the control and of the long recipe")
    parser.add_argument("--train_records", type=int, default=300, help="long training documents")
    parser.add_argument("--eval_per_bin", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    short_run = args.short_run or args.out / "short"
    if not (short_run / "checkpoints").exists():
        command("train", "--config", TOY, "--workdir", str(short_run))
    short = args.out / "short_drafter"
    if not (short / "config.json").exists():
        command("export", "--workdir", str(short_run), "--out", str(short))
    train_long, eval_long = write_long_records(args.out, args.train_records, args.eval_per_bin, args.seed)
    control = train_on(args.out / "short_plus", short, args.steps)
    long_rows = (f"--config.data.seq_len={LONG_ROW}", "--config.data.batch_size=1")
    documents = train_on(args.out / "long_plus", short, args.steps, *long_rows,
                         f"--config.data.train_files={train_long}")
    # The short records packed into long rows beside the documents (each source once an epoch): short contexts
    # keep their share of the updates.
    mixed = train_on(args.out / "long_mixed_plus", short, args.steps, *long_rows,
                     f"--config.data.train_files=('{SHORT_RECORDS}', '{train_long}')")

    drafters = {"short": short, f"short + {args.steps}": control, f"long documents + {args.steps}": documents,
                f"long mixed + {args.steps}": mixed}
    results = {name: evaluate(drafter, eval_long, args.out / f"eval_{drafter.name}.json")
               for name, drafter in drafters.items()}
    markdown = table(results)
    (args.out / "table.md").write_text(markdown + "\n")
    log(f"exact τ (B = 8) by prompt length on the long eval records, {time.monotonic() - started:.0f} s in all:\n"
        + markdown)


if __name__ == "__main__":
    main()

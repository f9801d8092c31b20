"""Step 3 of `make test-vllm` (project venv): what vLLM computed against what the project computes.

For each trained drafter that vLLM served (OUT/vllm_results.json from check_vllm.py; the Qwen3-MoE target's
too), on the same prompts
and the same continuations (vLLM's own greedy outputs), with the same exported files:
  - τ: the project's exact greedy τ (dflash_jax.eval.exact_tau, design §9) must lie within 10% of vLLM's
    accepted / drafts + 1. Both are pooled over every verification step (vLLM also drafts past the last
    kept token, so they need not agree to the token).
  - drafts: every draft vLLM made (with its CPU k_norm bug worked around, see check_vllm.py) must have the
    project drafter's log-probs at its anchor: |Δ log-prob| < 1e-3 on vLLM's top tokens of every slot.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash_jax.eval.exact_tau import DraftScorer, Example, evaluate_drafter  # noqa: E402
from dflash_jax.weights.targets import load_target  # noqa: E402
from dflash_jax.weights.drafter_files import load_drafter_dir  # noqa: E402

TAU_TOLERANCE, LOG_PROB_TOLERANCE = 0.10, 1e-3


def compare_drafts(scorer: DraftScorer, example: Example, steps: list) -> tuple[float, int, int]:
    """(max |Δ log-prob|, drafted tokens equal to the project's, drafted tokens) over vLLM's steps.

    Each step's anchor follows greedy block verification: it starts at the first generated token and moves
    by the accepted drafts + 1, exactly as vLLM's scheduler did.
    """
    sequence = np.concatenate([example.prompt_ids, example.continuation_ids]).astype(np.int32)
    _, tokens, log_probs = scorer(sequence)  # [T, B-1, top_k], sorted by log-prob
    anchor, end = len(example.prompt_ids), len(sequence)
    worst, equal, total = 0.0, 0, 0
    for values, ids in steps:
        if anchor >= end - 1:
            break  # drafts past the kept continuation
        values, ids = np.asarray(values), np.asarray(ids)
        for slot in range(ids.shape[0]):
            table = dict(zip(tokens[anchor, slot].tolist(), log_probs[anchor, slot].tolist()))
            worst = max(worst, max(abs(table[int(t)] - v) for t, v in zip(ids[slot], values[slot])))
        drafted = ids[:, 0]
        equal += int(np.sum(drafted == tokens[anchor, :, 0]))
        total += drafted.size
        known = sequence[anchor + 1:anchor + 1 + drafted.size]  # shorter near the end
        hits = drafted[:known.size] == known
        anchor += int(np.cumprod(hits).sum()) + 1
    return worst, equal, total


def compare_group(group: dict, served_group: dict) -> tuple[int, list[str]]:
    """(checks made, failures) for one target's trained drafters."""
    examples = [Example(np.asarray(prompt), np.asarray(continuation))
                for prompt, continuation in zip(group["prompts"], served_group["reference"])]
    target, target_config = load_target(group["target"], param_dtype=jnp.float32)  # vLLM ran float32 too
    failures, checks = [], 0
    for name, drafter_info in group["drafters"].items():
        served = served_group["drafters"][name]
        if not drafter_info["trained"] or "refused" in served:
            continue
        drafter, _ = load_drafter_dir(drafter_info["dir"])
        summary = evaluate_drafter(target, drafter, examples, budgets=())
        ours, theirs = summary["tau"], served["mean_acceptance_length"]
        accepted = round((ours - 1) * summary["verify_steps"])
        print(f"{name}: project exact tau {ours:.3f} ({accepted} accepted in {summary['verify_steps']} steps; "
              f"per-response mean {summary['tau_per_response']:.3f}) vs vLLM {theirs:.3f} "
              f"({served['accepted']:.0f} accepted in {served['drafts']:.0f} drafts)")
        checks += 2
        if abs(theirs / ours - 1) > TAU_TOLERANCE:
            failures.append(f"{name}: tau")

        scorer = DraftScorer(target, drafter, top_k=target_config.vocab_size)
        worst, equal, total = 0.0, 0, 0
        for example, steps in zip(examples, served["draft_log_probs"]):
            diff, same, count = compare_drafts(scorer, example, steps)
            worst, equal, total = max(worst, diff), equal + same, total + count
        print(f"{name}: vLLM's drafts vs the project drafter: max |Δ log-prob| {worst:.2e} over vLLM's top tokens "
              f"of every slot; drafted tokens equal {equal}/{total}")
        if worst > LOG_PROB_TOLERANCE:
            failures.append(f"{name}: draft log-probs")
    return checks, failures


def main(out_dir: str) -> None:
    out = Path(out_dir)
    artifacts = json.loads((out / "artifacts.json").read_text())
    results = json.loads((out / "vllm_results.json").read_text())
    checks, failures = compare_group(artifacts, results)
    moe_checks, moe_failures = compare_group(artifacts["moe"], results["moe"])  # the Qwen3-MoE target
    checks, failures = checks + moe_checks, failures + moe_failures
    print(f"vLLM vs project: {checks - len(failures)} passed, {len(failures)} failed")
    if failures:
        sys.exit(f"vLLM and the project disagree: {failures}")


if __name__ == "__main__":
    main(sys.argv[1])

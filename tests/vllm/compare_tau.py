"""Step 3 of `make test-vllm` (project venv): vLLM's mean acceptance length against the project's exact τ.

For each trained drafter that vLLM served (OUT/vllm_results.json from check_vllm.py), the project's exact
greedy τ (dflash_jax.eval.exact_tau, SPEC §9) of the same exported files on the same prompts and the same
continuations (vLLM's own greedy outputs) must lie within 10% of vLLM's accepted / drafts + 1. Both are
pooled over every verification step; vLLM also drafts past the last kept token, so they need not agree
to the token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash_jax.eval.exact_tau import Example, evaluate_drafter  # noqa: E402
from dflash_jax.models.target import load_target  # noqa: E402
from dflash_jax.weights.drafter_export import load_drafter_dir  # noqa: E402

TOLERANCE = 0.10


def main(out_dir: str) -> None:
    out = Path(out_dir)
    artifacts = json.loads((out / "artifacts.json").read_text())
    results = json.loads((out / "vllm_results.json").read_text())
    examples = [Example(prompt, continuation) for prompt, continuation in zip(artifacts["prompts"],
                                                                              results["reference"])]
    target, _ = load_target(artifacts["target"], param_dtype=jnp.float32)  # vLLM ran it in float32 too
    failures = []
    for name, drafter in artifacts["drafters"].items():
        served = results["drafters"][name]
        if not drafter["trained"] or "refused" in served:
            continue
        summary = evaluate_drafter(target, load_drafter_dir(drafter["dir"])[0], examples, budgets=())
        ours, theirs = summary["tau_pooled"], served["mean_acceptance_length"]
        accepted = round((ours - 1) * summary["verify_steps"])
        print(f"{name}: project exact tau {ours:.3f} ({accepted} accepted in {summary['verify_steps']} steps; "
              f"per-response mean {summary['tau']:.3f}) vs vLLM {theirs:.3f} ({served['accepted']:.0f} accepted "
              f"in {served['drafts']:.0f} drafts)")
        if abs(theirs / ours - 1) > TOLERANCE:
            failures.append(name)
    print(f"tau comparisons: {len([d for d in artifacts['drafters'].values() if d['trained']]) - len(failures)} "
          f"passed, {len(failures)} failed")
    if failures:
        sys.exit(f"vLLM's mean acceptance length is not within {TOLERANCE:.0%} of the project's tau for {failures}")


if __name__ == "__main__":
    main(sys.argv[1])

"""Evaluation results as flat scalars (for metrics.jsonl) and as text (for the terminal)."""

from __future__ import annotations


def flat_metrics(result: dict) -> dict[str, float]:
    """An `evaluate_drafter` result as scalars: tau (pooled), tau_per_response, greedy_agreement, acc_k
    (marginal), acc_given_prev_k (conditional), accepted_share_a (histogram), ddtree_tau_<budget> (pooled)
    and ddtree_tau_per_response_<budget>."""
    metrics = {name: float(result[name]) for name in ("tau", "tau_per_response", "greedy_agreement")}
    metrics.update({f"acc_{k}": float(v) for k, v in enumerate(result["slot_acceptance"], start=1)})
    metrics.update({f"acc_given_prev_{k}": float(v)
                    for k, v in enumerate(result["slot_acceptance_conditional"], start=1)})
    metrics.update({f"accepted_share_{a}": float(v) for a, v in enumerate(result["accepted_histogram"])})
    metrics.update({f"ddtree_tau_{budget}": float(v) for budget, v in result["ddtree_tau"].items()})
    metrics.update({f"ddtree_tau_per_response_{budget}": float(v)
                    for budget, v in result["ddtree_tau_per_response"].items()})
    return metrics


def format_result(title: str, result: dict) -> str:
    def row(values) -> str:
        return " ".join(f"{v:.3f}" for v in values)

    lines = [
        f"{title}: τ = {result['tau']:.3f} (pooled; per-response mean {result['tau_per_response']:.3f}) over "
        f"{result['responses']} responses, {result['verify_steps']} verification steps",
        f"  accepted drafts per step, shares of 0..{len(result['accepted_histogram']) - 1}: "
        f"{row(result['accepted_histogram'])}",
        f"  per-slot acceptance k=1..: {row(result['slot_acceptance'])}",
        f"  given slots 1..k-1 right:  {row(result['slot_acceptance_conditional'])}",
        ("  DDTree τ (pooled): " + ", ".join(f"budget {b}: {t:.3f}" for b, t in result["ddtree_tau"].items())
         if result["ddtree_tau"] else "  DDTree τ: not defined for this drafter (design §18.2)"),
    ]
    if result["greedy_agreement"] < 1:
        lines.append(f"  warning: only {result['greedy_agreement']:.1%} of the continuation tokens are the "
                     f"target's greedy choice, so τ follows the text rather than greedy decoding")
    return "\n".join(lines)


def format_speed(report: dict) -> str:
    """The `generate.benchmark` report: decode tokens/s of each decoder side by side, then τ and speed-up."""
    rates = report["tokens_per_second"]
    lines = ["decode tokens/s: " + ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items())]
    for title, figures in (("speculative", report), ("DDTree", report.get("ddtree"))):
        if figures is not None:
            budget = f" (budget {figures['budget']})" if "budget" in figures else ""
            lines.append(f"  {title}{budget}: τ = {figures['tau']:.3f} (pooled), speedup {figures['speedup']:.2f}x "
                         f"over plain greedy, {figures['outputs_differing_from_plain']} outputs differing from it")
    return "\n".join(lines)


def format_benchmark_table(scores: dict[str, dict]) -> str:
    """`evaluate --benchmark`'s figures as a Markdown table, a row per benchmark as in the published DFlash and
    DDTree tables: prompts and responses (turns), τ (pooled) and τ per response, DDTree τ per budget and, when
    timed, decode tokens/s of plain greedy, speculative and DDTree decoding with the speed-ups over plain."""
    first = next(iter(scores.values()))
    budgets = list(first["ddtree_tau"])
    header = ["benchmark", "prompts", "responses", "τ", "τ per response", *(f"DDTree τ ({b})" for b in budgets)]
    timed_tree = "speed" in first and "ddtree" in first["speed"]  # DSpark has no DDTree (design §18.2)
    if "speed" in first:
        header += ["plain tok/s", "speculative tok/s", "speed-up"]
    if timed_tree:
        header += [f"DDTree ({first['speed']['ddtree']['budget']}) tok/s", "DDTree speed-up"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for name, score in scores.items():
        cells = [name, str(score["prompts"]), str(score["responses"]), f"{score['tau']:.2f}",
                 f"{score['tau_per_response']:.2f}", *(f"{score['ddtree_tau'][b]:.2f}" for b in budgets)]
        if "speed" in score:
            speed, rates = score["speed"], score["speed"]["tokens_per_second"]
            cells += [f"{rates['plain']:.1f}", f"{rates['speculative']:.1f}", f"{speed['speedup']:.2f}×"]
        if timed_tree:
            cells += [f"{rates['ddtree']:.1f}", f"{speed['ddtree']['speedup']:.2f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

"""τ by context length (design §9.7): each response falls in the bin of its prompt's length in tokens, the
context the drafter drafts its first block against, and each bin is summarised like the whole set. A drafter
trained on short rows loses acceptance past the length it saw; these bins show where.

Bins are given by their upper edges, in tokens or with a K suffix (1K = 1024 tokens): "4K,8K,16K,32K" is
0-4K, 4K-8K, 8K-16K, 16K-32K and 32K+.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Sequence

DEFAULT_EDGES = ("4K", "8K", "16K", "32K")


def parse_edges(values: Sequence[str]) -> tuple[int, ...]:
    """Bin edges from "4096" / "4K" strings, strictly increasing and positive; ValueError otherwise."""
    edges = []
    for value in values:
        match = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", value)
        if match is None or int(match.group(1)) == 0:
            raise ValueError(f"context bin edge {value!r}: expected a positive token count such as 4096 or 4K")
        edges.append(int(match.group(1)) * (1024 if match.group(2) else 1))
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"context bin edges must increase, got {list(values)}")
    return tuple(edges)


def bin_of(tokens: int, edges: Sequence[int]) -> int:
    """Index of the bin [edges[i-1], edges[i]) holding `tokens` (the last bin is open-ended)."""
    return bisect.bisect_right(edges, tokens)


def bin_label(index: int, edges: Sequence[int]) -> str:
    low = 0 if index == 0 else edges[index - 1]
    return f"{_tokens(low)}+" if index == len(edges) else f"{_tokens(low)}-{_tokens(edges[index])}"


def _tokens(count: int) -> str:
    return f"{count // 1024}K" if count and count % 1024 == 0 else str(count)


def format_context_table(results: dict[str, dict]) -> str:
    """The `by_context` lists of several drafters' results ({"trained": ..., "untrained": ...}) as one table:
    a row per bin that holds responses, pooled τ (and the largest budget's DDTree τ) per drafter."""
    names = [name for name, result in results.items() if result.get("by_context")]
    if not names:
        return ""
    first = results[names[0]]["by_context"]
    budget = max((int(b) for b in first[0]["ddtree_tau"]), default=None)
    header = ["context", "responses", "verify steps"] + [f"τ {name}" for name in names]
    if budget is not None:
        header += [f"DDTree τ {name} (budget {budget})" for name in names]
    lines = ["τ by context length (prompt tokens):", "  " + " | ".join(header)]
    for i, row in enumerate(first):
        cells = [row["bin"], str(row["responses"]), str(row["verify_steps"])]
        cells += [_figure(results[name]["by_context"][i]["tau"]) for name in names]
        if budget is not None:
            cells += [_figure(results[name]["by_context"][i]["ddtree_tau"].get(budget, math.nan)) for name in names]
        lines.append("  " + " | ".join(cells))
    return "\n".join(lines)


def _figure(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"

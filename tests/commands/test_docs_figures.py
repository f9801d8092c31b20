"""Every measured figure the README and the guides under docs/ quote is one that bench/RESULTS.md records.

Pure text, no JAX. What counts as a figure, read from the markdown with the regexes below:

- a number followed by a unit of measurement (FIGURE), and not by another number (so "248320 × 8192", a shape,
  is not read): s, ms, min, h, GiB, GB, MiB, MB, TFLOP/s, GFLOP/s,
  tokens/s, tok/s, records/s, prompts/s, x or ×, %; "minutes", "hours" and "seconds" are read as min, h and s;
- a τ value (TAU): "τ 2.31", "τ = 2.31", "τ of 2.31", a number with two or more decimals after τ.

A number without a unit (a block size of 16, rows of 4096 tokens, 64 anchors, a version, a date) is a
configuration value, not a figure, and is never read. Neither are code blocks and inline code (commands and
their flag values), nor markdown links' targets. Before comparing, both texts are normalised the same way
(NORMALISE): thin and no-break spaces become spaces, "–" becomes "-", the space between a number and its unit is
dropped, and "×" becomes "x".

A figure must occur in bench/RESULTS.md, anywhere (a current table or the History). EXCEPTIONS lists the figures
that are not measurements (a setting, a hardware peak, arithmetic on recorded figures, a figure of another
project), each with its reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "RESULTS.md"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

UNITS = r"TFLOP/s|GFLOP/s|tokens/s|tok/s|records/s|prompts/s|GiB|MiB|GB|MB|ms|min|h|s|x|×|%"
FIGURE = re.compile(rf"(?<![\w.,/])(\d[\d,]*(?:\.\d+)?) ?({UNITS})(?![\w/])(?! ?\d)")
TAU = re.compile(r"τ(?: of| =)? (\d+\.\d{2,})")
LONG_UNITS = {"minutes": "min", "minute": "min", "hours": "h", "hour": "h", "seconds": "s", "second": "s"}

# (document, figure as normalised) -> why it is not a measurement that RESULTS.md must hold.
EXCEPTIONS = {
    # Settings and defaults.
    ("data.md", "8min"): "how long regenerate waits for an unreachable server before it stops, a setting",
    ("training.md", "30s"): "regenerate's first upload interval, a setting",
    ("failure_handling.md", "1s"): "the storage retries' first backoff, a setting",
    ("failure_handling.md", "30s"): "the storage retries' longest backoff and schedulers' notice periods, settings",
    ("failure_handling.md", "8MiB"): "the storage deadline's allowance per byte moved, a setting",
    ("failure_handling.md", "10s"): "the time an outage leaves a command to close its files, a setting",
    ("failure_handling.md", "25s"): "config.stop_grace_seconds' default",
    ("failure_handling.md", "240s"): "launch/retry.sh's backoff, doubled twice, a setting",
    ("failure_handling.md", "120s"): "schedulers' notice periods elsewhere",
    ("failure_handling.md", "300s"): "launch/slurm.sbatch signals this long before the time limit, a setting",
    ("failure_handling.md", "5min"): "the workdir lock's heartbeat timeout, a setting",
    ("scaling_and_launching.md", "6x"): "6 epochs, the recipes' setting",
    ("design.md", "1s"): "the storage retries' first backoff, a setting",
    ("design.md", "8MiB"): "the storage deadline's allowance per byte moved, a setting",
    ("design.md", "4%"): "the recipes' warmup share, a setting",
    ("design.md", "25%"): "the hybrid target's partial rotary factor, a configuration value",
    # Sizes that follow from shapes and hardware, not measurements.
    ("scaling_and_launching.md", "32GB"): "a v6e chip's HBM, from the chip table",
    ("scaling_and_launching.md", "6.3GiB"): "the 27B target's bf16 weights over 8 GPUs, arithmetic",
    ("scaling_and_launching.md", "64.6GiB"): "the 35B-A3B target's size in bf16, from its shapes",
    ("scaling_and_launching.md", "63%"): "the share of the model FLOP count (train/flops.py), computed from the shapes",
    ("design.md", "2.4GB"): "the 27B's Gated DeltaNet states for B rows, arithmetic on its shapes",
    ("design.md", "20GiB"): "one stacked expert projection of the 35B-A3B in bf16, from its shapes",
    ("design.md", "256MiB"): "2 × 32768 × 2048 × 2 bytes, arithmetic written out beside it",
    ("design.md", "64.6GiB"): "the 35B-A3B target's size in bf16, from its shapes",
    ("design.md", "48MiB"): "the state maps of a row of the 27B target, arithmetic on its shapes written beside it",
    ("design.md", "800GB"): "the 397B-A17B target's size, from its shapes",
    ("README.md", "3GB"): "the size of torch's CUDA wheels on the registry",
    ("export_and_serving.md", "8GB"): "the size of the vLLM TPU venv on disk",
    ("export_and_serving.md", "3min"): "the vLLM TPU venv's install time, not a benchmark",
    ("export_and_serving.md", "11%"): "tpu-inference pull request #3528's measurement, another project's",
    ("export_and_serving.md", "50%"): "tpu-inference pull request #3528's measurement, another project's",
    # "How long it takes": the tables' hours per billion tokens times the tokens of 6 or 20 epochs.
    **{("scaling_and_launching.md", hours): "arithmetic on the recorded hours per billion tokens"
       for hours in ("11h", "13h", "23h", "110h", "5.5h", "7.0h", "7.9h")},
}


def normalise(text: str) -> str:
    """NORMALISE: the same spelling for the same figure in both texts."""
    text = text.replace("\u2009", " ").replace("\u00a0", " ").replace("\u202f", " ").replace("–", "-")
    for long, short in LONG_UNITS.items():
        text = re.sub(rf"(\d) {long}\b", rf"\1 {short}", text)
    text = re.sub(rf"(\d) ({UNITS})(?![\w/])", r"\1\2", text)
    return text.replace("×", "x")


def prose(markdown: str) -> str:
    """The markdown without code blocks, inline code and link targets."""
    markdown = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    markdown = re.sub(r"^    \S.*$", " ", markdown, flags=re.M)  # indented code
    markdown = re.sub(r"`[^`\n]*`", " ", markdown)
    return re.sub(r"\]\([^)]*\)", "]", markdown)


def figures(markdown: str) -> set[str]:
    """The figures (normalised: "1.13s", "66%", "τ 2.407") a document quotes."""
    text = prose(markdown)
    found = set()
    for number, unit in FIGURE.findall(normalise_spaces(text)):
        found.add(normalise(f"{number} {unit}"))
    found.update(f"τ {value}" for value in TAU.findall(text))
    return found


def normalise_spaces(text: str) -> str:
    text = re.sub(r"(\d)[ \t]*\n[ \t]*(?=\S)", r"\1 ", text)  # a figure wrapped between its number and unit
    text = text.replace("\u2009", " ").replace("\u00a0", " ").replace("\u202f", " ").replace("–", "-")
    for long, short in LONG_UNITS.items():
        text = re.sub(rf"(\d) {long}\b", rf"\1 {short}", text)
    return text


def recorded(figure: str, results: str) -> bool:
    """Whether RESULTS.md holds the figure: the same number with the same unit, not inside a longer number."""
    if figure.startswith("τ "):
        return re.search(rf"(?<![\d.]){re.escape(figure[2:])}(?!\d)", results) is not None
    return re.search(rf"(?<![\d.,]){re.escape(figure)}(?![\w/])", results) is not None


def unrecorded(doc: Path, results: str) -> list[str]:
    return sorted(f for f in figures(doc.read_text()) if (doc.name, f) not in EXCEPTIONS and not recorded(f, results))


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_quoted_figure_is_in_the_results(doc):
    results = normalise(RESULTS.read_text())
    missing = unrecorded(doc, results)
    assert not missing, f"{doc.name} quotes figures bench/RESULTS.md does not hold: {missing}"


def test_every_exception_is_still_quoted():
    """An exception whose figure no document quotes any more is dropped, so the list stays short and true. (One that
    RESULTS.md happens to hold stays: a setting is not a measurement because a measurement shares its number.)"""
    quoted = {(doc.name, f) for doc in DOCS for f in figures(doc.read_text())}
    assert not set(EXCEPTIONS) - quoted, sorted(set(EXCEPTIONS) - quoted)


def test_the_extraction_reads_figures_and_leaves_settings():
    text = ("A step of 0.75 s - 1.13 s (66% MFU), 60.98 GiB a chip, 2.14× faster, exact τ 2.407 and τ = 1.5; "
            "block size 16, rows of 4096 tokens, 64 anchors, `--max_new_tokens 128`, JAX 0.10.2, 2026-12-05.")
    assert figures(text) == {"0.75s", "1.13s", "66%", "60.98GiB", "2.14x", "τ 2.407"}

"""A step time predicted from the compiled step (design §13): each resource's time is what the step asks of it
(FLOPs, HBM bytes, bytes on each link, per device: hlo_cost.py) over the chip's published peak (chips.py).

The step takes at least the slowest resource's time (perfect overlap of compute, memory traffic and
communication) and at most their sum (none overlapped); MFU, tokens/s and the run's duration follow for both
ends. Compute counts the larger of the model's FLOPs (train/flops.py, including the kernels the compiler cannot
see into) and the compiler's (including padded and masked work the model count leaves out).
"""

from __future__ import annotations

from typing import NamedTuple

from dflash_jax.planning.chips import Chip
from dflash_jax.planning.hlo_cost import HloCost


class Roofline(NamedTuple):
    chip: Chip
    seconds: dict[str, float]  # resource ("compute", "hbm", the chip's link names) -> time per step
    link_bytes: dict[str, float]  # link name -> bytes one device sends per step
    model_flops: float  # per device
    tokens_per_step: int
    steps: int | None  # the run's length; None when it is not known (config.epochs without a corpus size)

    @property
    def bound(self) -> str:
        return max(self.seconds, key=self.seconds.get)

    @property
    def step_seconds(self) -> tuple[float, float]:
        """(perfect overlap, no overlap)."""
        return max(self.seconds.values()), sum(self.seconds.values())

    @property
    def per_token(self) -> tuple[float, float]:
        """(no overlap, perfect overlap) over the step's tokens: what candidates are ranked by (with the batch
        given per device, one with more (data, fsdp) shards takes more rows a step)."""
        fastest, slowest = self.step_seconds
        return slowest / self.tokens_per_step, fastest / self.tokens_per_step

    def mfu(self, step_seconds: float) -> float:
        return self.model_flops / (self.chip.bf16_flops * step_seconds)


def roofline(cost: HloCost, model_flops: float, chip: Chip, tokens_per_step: int, steps: int | None) -> Roofline:
    """model_flops: the model count for one device's share of a step; steps: the run's length, if known."""
    link_bytes = {chip.local_link: 0.0, chip.remote_link: 0.0}
    for collective, size in cost.collective_bytes.items():
        link_bytes[chip.remote_link if collective.remote else chip.local_link] += size
    seconds = {"compute": max(model_flops, cost.flops) / chip.bf16_flops, "hbm": cost.hbm_bytes / chip.hbm_bandwidth,
               chip.local_link: link_bytes[chip.local_link] / chip.local_bandwidth,
               chip.remote_link: link_bytes[chip.remote_link] / chip.remote_bandwidth}
    return Roofline(chip, seconds, link_bytes, model_flops, tokens_per_step, steps)


def format_duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def format_run(line: Roofline) -> str:
    """The run's duration for both ends of the step time, or, without a length, the time per billion tokens."""
    fastest, slowest = line.step_seconds
    if line.steps is None:
        steps = 1e9 / line.tokens_per_step
        return f"{format_duration(fastest * steps)}-{format_duration(slowest * steps)} per billion tokens"
    return f"{line.steps} steps in {format_duration(fastest * line.steps)}-{format_duration(slowest * line.steps)}"


def format_ranges(line: Roofline) -> tuple[str, str, str]:
    """The step time, MFU and tokens/s, each as "low - high" (the step: perfect overlap - none; MFU and tokens/s:
    no overlap - perfect)."""
    fastest, slowest = line.step_seconds
    return (f"{format_seconds(fastest)} - {format_seconds(slowest)}",
            f"{line.mfu(slowest):.0%} - {line.mfu(fastest):.0%}",
            f"{line.tokens_per_step / slowest:,.0f} - {line.tokens_per_step / fastest:,.0f}")


def format_seconds(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.2f} MiB"


def format_roofline(line: Roofline, cost: HloCost) -> list[str]:
    chip = line.chip
    local, remote = chip.local_link, chip.remote_link
    peaks = {"compute": f"{chip.bf16_flops / 1e12:g} TFLOP/s", "hbm": f"{chip.hbm_bandwidth / 1e9:g} GB/s",
             local: f"{chip.local_bandwidth / 1e9:g} GB/s", remote: f"{chip.remote_bandwidth / 1e9:g} GB/s"}
    amounts = {"compute": f"{max(line.model_flops, cost.flops):.3g} FLOP", "hbm": format_bytes(cost.hbm_bytes),
               local: format_bytes(line.link_bytes[local]), remote: format_bytes(line.link_bytes[remote])}
    lines = [f"roofline per device on {chip.name} (peaks: {chip.source}):"]
    lines.extend(f"  {name:<8} {amounts[name]:>14} at {peaks[name]:>14}: {format_seconds(seconds):>9}"
                 for name, seconds in line.seconds.items())
    for collective, size in sorted(cost.collective_bytes.items(), key=lambda item: -item[1]):
        if size:
            axes = ",".join(collective.axes) or "-"
            lines.append(f"    {collective.kind:<18} over {axes:<18} {remote if collective.remote else local:<7} "
                         f"{format_bytes(size):>12}")
    step, mfu, tokens = format_ranges(line)
    lines.append(f"  bound: {line.bound}; step {step} (perfect overlap - none), MFU {mfu}, {tokens} tokens/s, "
                 f"{format_run(line)}")
    if cost.custom_calls:
        lines.append(f"  ({cost.custom_calls} kernel calls per step, whose FLOPs only the model count has)")
    if cost.unknown_loops:
        lines.append(f"  ({cost.unknown_loops} loops without a known trip count, counted once)")
    return lines

"""What a drafter method (design §18) decides, asked by the modules that differ per method instead of comparing
its name: which slot is the first drafted one, whether it has a DDTree, and how vLLM serves its export."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DrafterMethod:
    name: str  # config.drafter.method
    title: str  # the model card's name for it
    # design §18: slot 0 (the anchor's) is drafted too, predicting the token after the anchor; otherwise slot 0
    # holds the bonus token and slots 1..B-1 are drafted
    drafts_anchor_slot: bool
    # design §18.2, §18.4: a DDTree needs each depth's distribution to be independent of the token drafted above it
    has_ddtree: bool
    serve_method: str  # the `method` of vLLM's --speculative-config (design §10, §18.5)
    needs_v2_runner: bool  # vLLM (0.32) serves it only with its V2 model runner
    sglang_serves: bool  # SGLang's DFLASH algorithm serves the plain z-lab layout only
    tpu_served: bool  # vLLM TPU (0.32) and SGLang-JAX serve the plain z-lab layout only (weights/tpu_serving.py)
    # design §18: the low-rank Markov bias and the confidence head (DrafterConfig.markov_rank >= 1)
    has_markov_head: bool
    # design §18.4: the dynamic block convolution and the candidate selector (DrafterConfig's DFlash2 fields)
    has_block_convolution: bool
    # The export's config.json (design §10, §18.5): "z-lab" (DFlashDraftModel), "z-lab dflash2" (its own keys
    # beside z-lab's) or "speculators dspark" (speculators' layout naming the target); weights/drafter_files.py
    export_layout: str
    # The model card's opening paragraph, formatted with the drafter config's fields and draft_length
    card_summary: str
    # The card's rows of this method's own fields, (name, value template), placed after the layer rows
    card_rows: tuple[tuple[str, str], ...] = ()

    @property
    def first_slot(self) -> int:
        """The block slot of the first drafted token."""
        return 0 if self.drafts_anchor_slot else 1

    def draft_length(self, block_size: int) -> int:
        """Tokens one block drafts."""
        return block_size - self.first_slot

    def card_text(self, config) -> tuple[str, list[tuple[str, str]]]:
        """The model card's summary and its method rows for a drafter config (models/drafter.DrafterConfig)."""
        fields = {**vars(config), "draft_length": self.draft_length(config.block_size)}
        return (self.card_summary.format(**fields),
                [(name, value.format(**fields)) for name, value in self.card_rows])

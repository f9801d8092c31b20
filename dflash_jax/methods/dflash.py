"""DFlash: the block-diffusion backbone alone (design §18)."""

from dflash_jax.methods.base import DrafterMethod

DFLASH = DrafterMethod(
    name="dflash", title="DFlash", drafts_anchor_slot=False, has_ddtree=True, serve_method="dflash",
    needs_v2_runner=False, tpu_served=True, sglang_serves=True, has_markov_head=False, has_block_convolution=False,
    export_layout="z-lab",
    card_summary="""A [DFlash](https://z-lab.ai/projects/dflash) block-diffusion drafter: from the target's hidden states it drafts
{draft_length} tokens in one forward pass, which the target verifies in one pass. Trained with
dflash_jax; the weights are bf16 in the z-lab layout (`DFlashDraftModel`), without embedding or LM head (the
target's are shared).""")

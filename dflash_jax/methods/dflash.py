"""DFlash: the block-diffusion backbone alone (design §18)."""

from dflash_jax.methods.base import DrafterMethod

DFLASH = DrafterMethod(name="dflash", title="DFlash", drafts_anchor_slot=False, has_ddtree=True,
                       serve_method="dflash", needs_v2_runner=False,
                       tpu_served=True, sglang_serves=True, has_markov_head=False,
                       has_block_convolution=False)

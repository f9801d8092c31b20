"""DSpark: the backbone plus the low-rank Markov logit bias and the per-slot confidence head; every slot is
drafted (design §18). The Markov bias makes depth k depend on the token at depth k-1: no DDTree (§18.2)."""

from dflash_jax.methods.base import DrafterMethod

DSPARK = DrafterMethod(name="dspark", title="DSpark", drafts_anchor_slot=True, has_ddtree=False,
                       serve_method="dspark", needs_v2_runner=True,
                       tpu_served=False, sglang_serves=False, has_markov_head=True,
                       has_block_convolution=False)

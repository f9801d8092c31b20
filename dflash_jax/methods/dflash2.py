"""DFlash2: the backbone plus the dynamic block convolution and the candidate selector (design §18.4). The
selector reads the predecessor's candidate: no DDTree. vLLM serves it as method "dflash", its architecture
selecting the candidate walk (§18.5)."""

from dflash_jax.methods.base import DrafterMethod

DFLASH2 = DrafterMethod(name="dflash2", title="DFlash2", drafts_anchor_slot=False, has_ddtree=False,
                        serve_method="dflash", needs_v2_runner=True,
                        tpu_served=False, sglang_serves=False, has_markov_head=False,
                        has_block_convolution=True)

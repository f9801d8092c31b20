"""DSpark: the backbone plus the low-rank Markov logit bias and the per-slot confidence head; every slot is
drafted (design §18). The Markov bias makes depth k depend on the token at depth k-1: no DDTree (§18.2)."""

from dflash_jax.methods.base import DrafterMethod

DSPARK = DrafterMethod(
    name="dspark", title="DSpark", drafts_anchor_slot=True, has_ddtree=False, serve_method="dspark",
    needs_v2_runner=True, tpu_served=False, sglang_serves=False, has_markov_head=True, has_block_convolution=False,
    export_layout="speculators dspark",
    card_summary="""A DSpark drafter: the DFlash block-diffusion backbone drafts {draft_length} tokens in one forward pass
from the target's hidden states, a low-rank Markov head biases each token's logits by the token before it, and
a confidence head estimates each token's acceptance. Trained with dflash_jax; the weights are bf16 in the
speculators layout (`speculators_model_type: dspark`), without embedding or LM head (the target's are shared).
vLLM serves it with `method: "dspark"` on its V2 model runner (GPU).""",
    card_rows=(("Markov rank", "{markov_rank}"),))

"""DFlash2: the backbone plus the dynamic block convolution and the candidate selector (design §18.4). The
selector reads the predecessor's candidate: no DDTree. vLLM serves it as method "dflash", its architecture
selecting the candidate walk (§18.5)."""

from dflash_jax.methods.base import DrafterMethod

DFLASH2 = DrafterMethod(
    name="dflash2", title="DFlash2", drafts_anchor_slot=False, has_ddtree=False, serve_method="dflash",
    needs_v2_runner=True, tpu_served=False, sglang_serves=False, has_markov_head=False, has_block_convolution=True,
    export_layout="z-lab dflash2",
    card_summary="""A DFlash2 drafter: the DFlash block-diffusion backbone, with a dynamic two-tap convolution within the
block around each attention and MLP sublayer, drafts {draft_length} tokens in one forward pass from the
target's hidden states, and a candidate selector picks each token among the {selector_top_k} most likely
by the token before it. Trained with dflash_jax; the weights are bf16 in the z-lab layout (`DFlash2DraftModel`),
without embedding or LM head (the target's are shared). vLLM serves it with `method: "dflash"` on its V2 model
runner (GPU).""",
    card_rows=(("convolution taps / group", "{conv_kernel_size} / {conv_group_size}"),
               ("selector rank / candidates", "{selector_rank} / {selector_top_k}")))

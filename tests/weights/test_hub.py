"""Targets and drafters named by Hugging Face Hub repo id, resolved from a local Hugging Face cache with
HF_HUB_OFFLINE=1 (no network): the cache is laid out as huggingface_hub lays it out (blobs, snapshots, refs),
which its own cache scanner confirms; an id that is in no cache is one clear line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from huggingface_hub import scan_cache_dir

from tests.train_fixtures import make_target

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_hub_cache(cache: Path, repo_id: str, source: Path) -> Path:
    """Put the files of `source` into `cache` as a download of model `repo_id` at COMMIT (branch main) would:
    content-addressed blobs, a snapshot of relative symlinks to them, and refs/main naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def regenerate(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent / "hf_home"),
               JAX_DISABLE_MOST_OPTIMIZATIONS="1")  # a tiny model: compile time dominates
    return subprocess.run([sys.executable, "-m", "dflash_jax.regenerate", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_target_named_by_repo_id_resolves_from_the_cache_offline(tmp_path):
    target = make_target(tmp_path / "target", num_layers=2)
    cache = tmp_path / "hub_cache"
    add_to_hub_cache(cache, "tiny-org/tiny-qwen3", target)
    (repo_info,) = scan_cache_dir(cache).repos  # huggingface_hub reads it as one of its own downloads
    assert repo_info.repo_id == "tiny-org/tiny-qwen3" and {r.commit_hash for r in repo_info.revisions} == {COMMIT}

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello world"}) + "\n")
    config = tmp_path / "config.py"
    config.write_text("from tests.train_fixtures import tiny_config\n\n\ndef get_config():\n"
                      f"    return tiny_config('tiny-org/tiny-qwen3', {str(prompts)!r})\n")
    common = [f"--config={config}", f"--prompts={prompts}", "--max_new_tokens=6", "--batch_size=1", "--quiet"]
    by_id = regenerate([*common, f"--out={tmp_path / 'by_id.jsonl'}"], cache)
    assert by_id.returncode == 0, by_id.stderr[-3000:]
    (record,) = [json.loads(line) for line in (tmp_path / "by_id.jsonl").read_text().splitlines()]
    assert record["prompt"] == "Hello world" and record["completion"]  # the cached target's greedy continuation

    unknown = regenerate([*common, "--config.target_dir=tiny-org/missing", f"--out={tmp_path / 'x.jsonl'}"], cache)
    assert unknown.returncode == 2
    (line,) = unknown.stderr.strip().splitlines()
    assert line == (f"error: target 'tiny-org/missing' is neither a local directory nor in the Hugging Face cache "
                    f"{cache}, and HF_HUB_OFFLINE is set")

"""`make demo`'s job, run as the demo runs it: train with configs/toy.py, evaluate exact τ on the held-out toy
prompts (the target's own greedy continuations); the trained drafter must reach the τ target against the
untrained one. Then export and reload.

The demo (about eight and a half minutes on 2 CPU cores) runs in `make test-slow`. Measured figures: bench/RESULTS.md
"Toy drafter"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.command import REPO, SCRIPT


def run(*args: str) -> None:
    """`dflash-jax *args` as `make demo` runs it: one CPU device, as on a laptop (the suite's conftest
    simulates 8)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run([str(SCRIPT), *args], check=True, cwd=REPO, env=env)


def toy_job(config: str, out: Path) -> tuple[dict, Path]:
    """Train and evaluate as `make demo` does; returns the evaluation and the workdir."""
    workdir = out / "run"
    run("train", "--config", config, "--workdir", str(workdir))
    run("evaluate", "--config", config, "--workdir", str(workdir),
        "--max_new_tokens", "128", "--json", str(out / "eval.json"))
    return json.loads((out / "eval.json").read_text()), workdir


def check_evaluation(results: dict) -> None:
    """What the toy evaluation must show: the τ target (pooled τ >= 2.0 at B = 8 and >= 1.5x the untrained
    drafter's) and the invariants of the evaluator."""
    trained, untrained = results["trained"], results["untrained"]
    assert results["continuation"] == "generate" and trained["responses"] == 64
    assert trained["greedy_agreement"] == 1.0  # τ of the target's own greedy decoding
    assert untrained["tau"] < 1.02, untrained["tau"]
    # A tree of candidates never accepts less than the single greedy chain.
    assert trained["ddtree_tau"]["22"] >= trained["ddtree_tau"]["8"] >= trained["tau"] - 1e-9
    assert trained["tau"] >= 2.0 and trained["tau"] >= 1.5 * untrained["tau"], (trained["tau"], untrained["tau"])
    assert trained["slot_acceptance"][0] >= 0.1, trained["slot_acceptance"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    # DFLASH_JAX_DEMO_OUT keeps the run for later checks (`make test-vllm TOY_RUN=...` serves its drafter).
    kept = os.environ.get("DFLASH_JAX_DEMO_OUT")
    out = Path(kept).absolute() if kept else tmp_path_factory.mktemp("demo")
    if kept:
        shutil.rmtree(out, ignore_errors=True)  # a fresh run: an earlier one would be resumed, not trained
        out.mkdir(parents=True)
    results, workdir = toy_job("configs/toy.py", out)
    export = out / "drafter"
    run("export", "--workdir", str(workdir), "--out", str(export))
    return results, workdir, export


@pytest.mark.slow
def test_demo_training_reaches_the_tau_target(demo):
    results, _, _ = demo
    check_evaluation(results)


@pytest.mark.slow
def test_exported_toy_drafter_reloads_with_the_trained_weights(demo):
    import jax.numpy as jnp
    from flax import nnx

    from dflash_jax.train.checkpoint import restore_drafter
    from dflash_jax.weights.drafter_files import load_drafter_dir

    _, workdir, export = demo
    trained, trained_config, _ = restore_drafter(workdir, None)
    loaded, loaded_config = load_drafter_dir(export)
    assert loaded_config == trained_config
    trained_params, loaded_params = (nnx.state(m, nnx.Param).flat_state() for m in (trained, loaded))
    for (path, ours), (loaded_path, exported) in zip(trained_params, loaded_params):
        assert path == loaded_path
        # The export stores bf16 (design §10): the reloaded weights are the trained ones rounded to bf16.
        np.testing.assert_array_equal(np.asarray(ours[...].astype(jnp.bfloat16).astype(jnp.float32)),
                                      np.asarray(exported[...]))


"""`make demo`'s job, run as the demo runs it: train with configs/toy.py, evaluate exact τ on the held-out toy
prompts (the target's own greedy continuations) against the untrained drafter, export and reload.
Slow (about five minutes on 2 CPU cores): run by `make test-slow`.

The floor below is what the demo's five-minute training reliably reaches (τ 1.21 measured, see
bench/RESULTS.md "Toy drafter"); the goal of τ >= 2.0 needs a longer run and is not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def run(*args: str) -> None:
    # Single CPU device, as `make demo` runs on a laptop (the suite's conftest simulates 8).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run([sys.executable, *args], check=True, cwd=REPO, env=env)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    workdir, export = out / "run", out / "drafter"
    run("-m", "dflash_jax.train", "--config", "configs/toy.py", "--workdir", str(workdir))
    run("-m", "dflash_jax.evaluate", "--config", "configs/toy.py", "--workdir", str(workdir),
        "--max_new_tokens", "128", "--json", str(out / "eval.json"))
    run("convert/export_drafter.py", "--workdir", str(workdir), "--out", str(export))
    return json.loads((out / "eval.json").read_text()), workdir, export


def test_demo_training_raises_tau_above_the_untrained_drafter(demo):
    results, _, _ = demo
    trained, untrained = results["trained"], results["untrained"]
    assert results["continuation"] == "generate" and trained["responses"] == 64
    assert trained["greedy_agreement"] == 1.0  # τ of the target's own greedy decoding
    assert untrained["tau"] < 1.02, untrained["tau"]
    assert trained["tau"] >= 1.15, trained["tau"]
    assert trained["slot_acceptance"][0] >= 0.1, trained["slot_acceptance"]
    # A tree of candidates never accepts less than the single greedy chain.
    assert trained["ddtree_tau"]["22"] >= trained["ddtree_tau"]["8"] >= trained["tau"] - 1e-9


def test_exported_toy_drafter_reloads_with_the_trained_weights(demo):
    import jax.numpy as jnp
    from flax import nnx

    from dflash_jax.train.checkpoint import restore_drafter
    from dflash_jax.weights.drafter_export import load_drafter_dir

    _, workdir, export = demo
    trained, trained_config, _ = restore_drafter(workdir, None)
    loaded, loaded_config = load_drafter_dir(export)
    assert loaded_config == trained_config
    trained_params, loaded_params = (nnx.state(m, nnx.Param).flat_state() for m in (trained, loaded))
    for (path, ours), (loaded_path, exported) in zip(trained_params, loaded_params):
        assert path == loaded_path
        # The export stores bf16 (SPEC §10): the reloaded weights are the trained ones rounded to bf16.
        np.testing.assert_array_equal(np.asarray(ours[...].astype(jnp.bfloat16).astype(jnp.float32)),
                                      np.asarray(exported[...]))

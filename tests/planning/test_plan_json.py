"""`plan --json` (dflash_jax/planning/report.py): the figures the tables print, machine-readable, for a
compiled candidate of `plan --compare` on a simulated two-host GPU cluster."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.command import dflash_jax
from tests.train_fixtures import make_target

ITEM_BYTES = {"bf16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1}


@pytest.mark.slow  # a comparison of every mesh of 2 x 2 H200 (~20 s); test_plan's command test writes --json too
def test_compare_json_holds_every_figure_of_the_table(tmp_path):
    target = make_target(tmp_path / "qwen3")
    out = tmp_path / "plan.json"
    result = dflash_jax("plan", "--config", "configs/tiny.py", f"--config.target_dir={target}", "--topology",
                        "gpu:H200x2x2", "--compare", "--layouts", "fsdp", "--tensor_sizes", "1,4",
                        "--hbm_gib", "80", "--json", str(out), devices=4)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    # tensor=4 spans more than a host of 2 GPUs: no candidate, so one compile.
    assert [(c["layout"], c["plan"] is not None) for c in record["candidates"]] == [("fsdp", True)]
    best = record["candidates"][0]
    assert record["best"] == {"layout": best["layout"], "mesh": best["mesh"]}
    assert best["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1, "context": 1, "dcn_data": 2} and best["fits"]
    # The table's row for the best candidate shows the same memory, step range and bound.
    row = next(line for line in result.stdout.splitlines() if line.startswith(f"| {best['layout']} |"))
    plan = best["plan"]
    memory, prediction = plan["memory_bytes"], plan["prediction"]
    assert memory["budget"] == 80 * 2**30 and 0 < memory["total"] <= memory["budget"]
    assert memory["total"] >= memory["arguments"] >= memory["target_weights"] + memory["drafter_parameters"]
    assert f"| {prediction['bound']} |" in row
    assert prediction["chip"] == "H200"
    fastest, slowest = prediction["step_seconds"]
    assert math.isclose(fastest, max(prediction["seconds_by_resource"].values()))
    assert math.isclose(slowest, sum(prediction["seconds_by_resource"].values()))
    assert prediction["mfu"][0] >= prediction["mfu"][1] > 0
    # Collective bytes by kind add up to what each link carries; data parallelism crosses the hosts.
    links = {"nvlink": 0.0, "network": 0.0}
    for collective in plan["collective_bytes"]:
        links["network" if collective["remote"] else "nvlink"] += collective["bytes"]
    assert links == prediction["link_bytes"]
    assert any(c["remote"] and c["axes"] == ["data"] for c in plan["collective_bytes"])
    # Largest arrays: structured, largest first, bytes equal to their shape times the item size.
    arrays = plan["largest_arrays"]
    assert arrays and [a["bytes"] for a in arrays] == sorted((a["bytes"] for a in arrays), reverse=True)
    for array in arrays:
        assert array["bytes"] == math.prod(array["shape"]) * ITEM_BYTES[array["dtype"]]
        assert re.fullmatch(r"[a-z-]+", array["op"])
    assert plan["flops"]["model_all_devices"] == 4 * plan["flops"]["model_per_device"] > 0
    assert plan["flops"]["compiler_per_device"] > 0

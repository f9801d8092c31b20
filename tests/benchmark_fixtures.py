"""Each benchmark's rows with the real columns, in the sources the benchmark tests read: a local Hugging Face
cache for the Hub ids, files and saved datasets for the rest."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

ROWS = {
    "gsm8k": [{"question": f"Tom has {i} apples and {{x}} pears. How many \\items?", "answer": f"#### {i}"}
              for i in range(7)],
    "math500": [{"problem": f"Find $x$ if $x^{i} = \\frac{{1}}{{2}}$.", "solution": "s", "answer": "1/2",
                 "subject": "Algebra", "level": i % 5 + 1, "unique_id": f"test/algebra/{i}.json"} for i in range(6)],
    "humaneval": [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n",
                   "canonical_solution": f"    return x + {i}\n", "test": "def check(f): pass\n",
                   "entry_point": f"f{i}"} for i in range(4)],
    "mbpp": [{"source_file": "Benchmark Questions Verification V2.ipynb", "task_id": 11 + i,
              "prompt": f"Write a python function to add {i} to a number.", "code": f"def f(x): return x + {i}",
              "test_imports": [], "test_list": [f"assert f(1) == {1 + i}"]} for i in range(5)],
    "mt-bench": [{"prompt": [f"Compose a travel blog post number {i}.", "Rewrite it starting every sentence with A."],
                  "prompt_id": 81 + i, "category": "writing", "reference": []} for i in range(3)],
    "alpaca": [{"instruction": f"Give {i} tips for staying healthy.", "input": "" if i % 3 else f"context {i}",
                "output": "o", "text": "t"} for i in range(9)],
    # LongBench's published JSONL fields (qasper_e.jsonl's): documents of growing length, a question on each.
    "longbench": [{"input": f"What is item {i}?", "context": " ".join(f"Item {j} is {j * j}." for j in range(8 * i)),
                   "answers": [str(i * i)], "length": 32 * i, "dataset": "qasper_e", "language": "en",
                   "all_classes": None, "_id": f"id{i}"} for i in range(1, 5)],
}


def snapshot(hub: Path, dataset_id: str) -> Path:
    """The directory `hf download DATASET --repo-type dataset` fills in the cache at `hub`."""
    repo = hub / f"datasets--{dataset_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    return snapshot


def write_sources(base: Path) -> dict:
    """Each benchmark's rows in one kind of source under `base`; the Hub ids in a local Hugging Face cache (the
    `hub` directory): openai/gsm8k with its two configs as the real repo declares them, tatsu-lab/alpaca."""
    hub = base / "hub"
    gsm8k = snapshot(hub, "openai/gsm8k")
    for config, rows in (("main", ROWS["gsm8k"]), ("socratic", ROWS["gsm8k"][::-1])):
        (gsm8k / config).mkdir()
        pq.write_table(pa.Table.from_pylist(rows), gsm8k / config / "test-00000-of-00001.parquet")
        pq.write_table(pa.Table.from_pylist(rows[:2]), gsm8k / config / "train-00000-of-00001.parquet")
    (gsm8k / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {config}\n  data_files:\n  - split: train\n    path: {config}/train-*\n"
        f"  - split: test\n    path: {config}/test-*\n" for config in ("main", "socratic")) + "---\n")
    alpaca = snapshot(hub, "tatsu-lab/alpaca") / "data"
    alpaca.mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS["alpaca"]), alpaca / "train-00000-of-00001-a09b74b3ef9c3b56.parquet")

    math500 = base / "math500.jsonl"
    math500.write_text("".join(json.dumps(row) + "\n" for row in ROWS["math500"]))
    humaneval = base / "humaneval.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS["humaneval"]), humaneval)
    mbpp = base / "mbpp"  # a DatasetDict: its "test" split is read
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS["mbpp"]),
                          "train": datasets.Dataset.from_list(ROWS["mbpp"][:1])}).save_to_disk(mbpp)
    mt_bench = base / "mt_bench"
    datasets.Dataset.from_list(ROWS["mt-bench"]).save_to_disk(mt_bench)
    longbench = base / "qasper_e.jsonl"
    longbench.write_text("".join(json.dumps(row) + "\n" for row in ROWS["longbench"]))
    return {"hub": hub, "math500": math500, "humaneval": humaneval, "mbpp": mbpp, "mt-bench": mt_bench,
            "longbench": longbench}

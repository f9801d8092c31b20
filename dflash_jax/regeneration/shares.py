"""Several processes regenerating one output (design §14): each writes its share to a part file, process 0
merges the parts into the output in input order.

Process p of P takes input records p, p + P, p + 2P, ... and appends one line per record, in order, to
OUT.jsonl.part-p-of-P, a ResumableJsonl of its own (a record that is not written, a prompt too long or an
empty completion, is a `null` line there), so line k of part p is input record p + kP. When every process
has finished its share, process 0 appends the parts' lines to OUT.jsonl round-robin, skipping the nulls,
through OUT's own progress file, then removes the parts. Every step resumes: a rerun finds each part at its
recorded length and continues it, and a merge stopped halfway continues from OUT's record count (the parts
stay until it is complete), so every record is written exactly once.
"""

from __future__ import annotations

import os

from etils import epath

from dflash_jax.runtime.errors import DataError
from dflash_jax.runtime.paths import as_path
from dflash_jax.regeneration.output import PROGRESS_SUFFIX, ResumableJsonl

MERGE_CHUNK = 4096  # input records per append of the merge


def part_path(out: str | os.PathLike, process: int, processes: int) -> epath.Path:
    """Beside OUT, local or in a bucket (design §7.1: there, each a staged file of its own)."""
    out = as_path(out)
    return out.with_name(f"{out.name}.part-{process}-of-{processes}")


def check_no_foreign_parts(out: str | os.PathLike, processes: int) -> None:
    """Refuse to start over parts a run with another process count left (its shares differ from ours)."""
    out = as_path(out)
    expected = {part_path(out, p, processes).name for p in range(processes)} if processes > 1 else set()
    foreign = sorted(p.name for p in out.parent.glob(f"{out.name}.part-*-of-*")
                     if not p.name.endswith(PROGRESS_SUFFIX) and p.name not in expected)
    if foreign:
        counts = sorted({int(name.rsplit("-of-", 1)[1]) for name in foreign if name.rsplit("-of-", 1)[1].isdigit()})
        needed = " or ".join(map(str, counts)) or "that many"
        raise DataError(str(out), f"has the parts of a job of {needed} processes ({', '.join(foreign)}), not "
                                  f"{processes}: rerun it with {needed} processes to finish it, or remove the parts "
                                  f"to start over")


def merge_parts(output: ResumableJsonl, processes: int, total: int) -> None:
    """Append records output.records_done..total-1 of the parts to `output` in input order, then remove the
    parts. Every part must hold its whole share."""
    parts = [part_path(output.path, p, processes) for p in range(processes)]
    handles = [part.open(encoding="utf-8") for part in parts]
    try:
        for process, handle in enumerate(handles):  # the lines of records already merged
            for _ in range(len(range(process, output.records_done, processes))):
                handle.readline()
        for first in range(output.records_done, total, MERGE_CHUNK):
            lines = []
            for index in range(first, min(first + MERGE_CHUNK, total)):
                line = handles[index % processes].readline()
                if not line.endswith("\n"):
                    raise DataError(str(parts[index % processes]), f"ends before input record {index}; it is "
                                                                   f"not a finished part of this output")
                if line != "null\n":
                    lines.append(line)
            output.append_lines(lines, min(first + MERGE_CHUNK, total) - first)
    finally:
        for handle in handles:
            handle.close()
    for part in parts:
        for path in (part, part.with_name(part.name + PROGRESS_SUFFIX)):
            path.unlink(missing_ok=True)

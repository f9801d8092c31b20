"""Experiment tracking (design §15): every log record of the train loop goes to TensorBoard event files in the workdir
(`<workdir>/tensorboard`, on by default) and, when `config.wandb_project` is set, to Weights & Biases.
`metrics.jsonl` is written by the loop itself; these are views of the same records.

TensorBoard files are written with tensorboardX: a small, maintained writer of the event-file format that
needs only numpy and protobuf. The JAX ecosystem's writers were the first choice but pull a framework in:
clu's `metric_writers.SummaryWriter` and flax's `metrics.tensorboard` write through TensorFlow's
`tf.summary`, clu's torch writer through PyTorch. W&B is imported only when a project is set.

A resumed run restarts from its newest checkpoint, so the steps a crashed run logged after that checkpoint
are logged again. The writer opened on resume starts with TensorBoard's purge marker (a SessionLog.START at
the first step to come): TensorBoard then drops every earlier-written point at or past that step, and shows
each step once. W&B continues the same run (its id is kept in the workdir) and ignores points at steps it
already has; metrics.jsonl is the complete record.

In a bucket workdir the event files are kept in memory and uploaded whole at each record through the bounded
filesystem (`_BucketEventFiles`, design §7.2): tensorboardX's own gs:// writer is another client
(google-cloud-storage) that takes no private endpoint and has no deadline, and a local copy would be one more
file that a full disk could stop.
"""

from __future__ import annotations

import io
import logging
import numbers
import os
from typing import Any

from etils import epath
from ml_collections import ConfigDict

from dflash_jax.runtime.errors import ConfigError
from dflash_jax.runtime.paths import as_path, cache_root, filesystem, is_url

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
WANDB_RUN_ID_FILE = "wandb_run_id"


def scalar_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers as TensorBoard/W&B tags: training metrics under `train/`, the eval hook's
    (already `eval/...`) as they are; the step and values that are not numbers (None: not measured) left out."""
    scalars = {}
    for name, value in record.items():
        if name == "step" or isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        scalars[name if "/" in name else f"train/{name}"] = float(value)
    return scalars


class Trackers:
    """The TensorBoard writer and the W&B run of one training run (either may be off). `start_step` is the
    step the run resumes from (0 for a fresh run)."""

    def __init__(self, workdir: str | os.PathLike, config: ConfigDict, start_step: int):
        workdir = as_path(workdir)
        self._tensorboard = self._wandb = self._in_bucket = None
        if config.tensorboard:
            from tensorboardX import SummaryWriter
            directory = os.fspath(workdir / TENSORBOARD_DIR)
            if is_url(workdir):
                self._in_bucket = _BucketEventFiles(directory)
                directory = self._in_bucket.logdir
            # purge_step: hide what a previous run logged at steps >= start_step + 1 (see the module docstring).
            self._tensorboard = SummaryWriter(directory, purge_step=start_step + 1 if start_step else None)
        if config.wandb_project:
            self._wandb = _wandb_run(workdir, config)

    def write(self, step: int, record: dict[str, Any]) -> None:
        scalars = scalar_metrics(record)
        if self._tensorboard is not None:
            for tag, value in scalars.items():
                self._tensorboard.add_scalar(tag, value, global_step=step)
            self._tensorboard.flush()
            if self._in_bucket is not None:
                self._in_bucket.upload()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            if self._in_bucket is not None:
                self._in_bucket.upload()
        if self._wandb is not None:
            self._wandb.finish()


class _BucketEventFiles:
    """The event files of one SummaryWriter in a bucket directory: tensorboardX writes them through this writer
    factory (registered under a prefix of the writer's logdir, as tensorboardX's own gs:// writer is) into memory,
    and `upload` puts each whole in the bucket."""

    PREFIX = "dflash-jax-bucket"

    def __init__(self, url: str):
        from tensorboardX.record_writer import register_writer_factory

        self._fs, self._key = filesystem(url)
        self.logdir = f"{self.PREFIX}:{url}"
        self._files: dict[str, _EventFile] = {}
        register_writer_factory(self.PREFIX, self)  # the newest writer's: one SummaryWriter per process

    def open(self, path: str) -> _EventFile:
        self._files[path.rsplit("/", 1)[-1]] = file = _EventFile()
        return file

    def directory_check(self, path: str) -> None:
        """Nothing to make: an object store has no directories."""

    def upload(self) -> None:
        for name, file in self._files.items():
            self._fs.pipe_file(f"{self._key}/{name}", file.getvalue())


class _EventFile:
    """An event file in memory, as tensorboardX writes one (write, flush, close); readable after its close."""

    def __init__(self):
        self._bytes = io.BytesIO()

    def write(self, data: bytes) -> None:
        self._bytes.write(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def getvalue(self) -> bytes:
        return self._bytes.getvalue()


def _wandb_run(workdir: epath.Path, config: ConfigDict):
    """A W&B run for the workdir: the same one again when a resumed run finds its id there."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("config.wandb_project is set but wandb is not installed (pip install wandb)") from None
    id_file = workdir / WANDB_RUN_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
    id_file.write_text(run_id + "\n")
    log.info("logging to W&B project %s, run %s", config.wandb_project, run_id)
    return wandb.init(project=config.wandb_project, entity=config.wandb_entity, name=workdir.name, id=run_id,
                      resume="allow", config=config.to_dict(),
                      dir=os.fspath(cache_root() / "wandb" if is_url(workdir) else workdir))  # W&B writes locally

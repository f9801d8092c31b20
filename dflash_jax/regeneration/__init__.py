"""Data regeneration: the target's own responses to prompt records, as training JSONL (`regenerate.py` is the
command; `records.py` the formats, `output.py` the resumable output; in JAX: `decode.py` the batched decoding,
`job.py` the loop over batches; through serving engines: `server_client.py` the HTTP requests, `server_job.py`
the concurrent job)."""

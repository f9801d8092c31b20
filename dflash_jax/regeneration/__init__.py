"""Data regeneration: the target's own responses to prompt records, as training JSONL (`regenerate.py` is the
command; `records.py` the formats, `output.py` the resumable output; in JAX: `decode.py` the continuously
batched decoding, `slots.py` its cache surgery, `job.py` the loop over windows of records, `shares.py` the
parts several processes write and their merge; through serving engines: `server_client.py` the HTTP
requests, `server_job.py` the concurrent job)."""

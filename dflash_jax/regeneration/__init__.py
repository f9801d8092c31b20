"""Data regeneration: the target's own responses to prompt records, as training JSONL (`regenerate.py` is the
command; `decode.py` the batched decoding, `records.py` the formats, `output.py` the resumable output,
`job.py` the loop over batches)."""

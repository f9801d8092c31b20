"""Command-line converters: HF target -> Orbax (hf_to_orbax.py), trained drafter -> vLLM export (export_drafter.py)."""

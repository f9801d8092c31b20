"""Flax NNX models: shared layers, the Qwen3 and Qwen3.5 targets, and the DFlash drafter."""

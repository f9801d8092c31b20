"""Reading and writing checkpoints: Hugging Face safetensors directories and name mappings."""

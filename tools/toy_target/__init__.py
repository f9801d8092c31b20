"""The pieces of `tools/make_toy_target.py`: corpus and tokenizer, language-model training, drafter data,
and the asset README."""

"""Every command's entry point, each a thin layer of flags over the library, and the runner they share (cli.py)."""

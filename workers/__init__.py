"""Processes: one module per worker kind, plus the `rlpipe` command line (`cli.py`)."""

"""The `rlpipe` command and the tools it runs beside the workers: run commands, the demo, chaos runs."""

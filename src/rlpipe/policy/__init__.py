"""Model files: SmolLM2 prepared from its GGUF, the tiny test Llama, checkpoints, chat format."""

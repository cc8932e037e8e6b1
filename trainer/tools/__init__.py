"""Commands for users beside training: ``python -m trainer.tools.tiny_hf OUT_DIR`` (tiny Hugging Face models
and data, made offline)."""

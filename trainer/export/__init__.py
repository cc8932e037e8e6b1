"""Weights out of a checkpoint: safetensors, Hugging Face directories, and text generation from any checkpoint."""

"""Weights out of a checkpoint: safetensors, Hugging Face directories, PEFT adapter directories, and text generation
from any checkpoint."""

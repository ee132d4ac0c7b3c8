"""Models built from the sp_jax layers (and :mod:`sp_jax.models.hf`: Hugging Face
checkpoints in and out)."""

from sp_jax.models.gpt import GPT, Block, GPTConfig, RopeScaling

__all__ = ["GPT", "GPTConfig", "Block", "RopeScaling"]

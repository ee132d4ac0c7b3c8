"""Models built from the sp_jax layers."""

from sp_jax.models.gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "GPTConfig", "Block"]

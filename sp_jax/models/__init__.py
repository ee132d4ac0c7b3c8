"""Models built from the sp_jax layers (and :mod:`sp_jax.models.hf`: Hugging Face
checkpoints in and out)."""

from sp_jax.models import lora  # noqa: E402  (sp_jax.models.lora.apply)
from sp_jax.models.blocks import Block
from sp_jax.models.generation import (
    Generation,
    SpeculativeGeneration,
    filter_logits,
    generate,
    sample_tokens,
)
from sp_jax.models.gpt import GPT
from sp_jax.models.gpt_config import GPTConfig, RopeScaling, YarnScaling

__all__ = ["GPT", "GPTConfig", "Block", "Generation", "RopeScaling", "SpeculativeGeneration",
           "YarnScaling", "filter_logits", "generate", "sample_tokens", "lora"]

"""jax_impl in bf16: the jax adapter with bf16 weights and activations (the DeltaNet rule, its state and the logits
stay float32), compared with the bf16 tolerance profile (INTERPRETING.md section 6)."""

from . import register_engine
from .jax import Jax


@register_engine("jax_bf16")
class JaxBf16(Jax):
    dtype = "bfloat16"
    precision = "bf16"

"""mlx-flash: FlashAttention for MLX. Fused, O(N)-memory attention forward and backward.

    import mlx_flash
    out = mlx_flash.flash_attention(q, k, v, mask="causal")
"""
from .api import flash_attention, scaled_dot_product_attention
from .fallback import FallbackWarning, fallback_counts, reset_fallback_counts, route_counts
from .spec import AttentionSpec

__version__ = "0.1.0"
__all__ = ["flash_attention", "scaled_dot_product_attention", "fallback_counts",
           "route_counts", "reset_fallback_counts", "FallbackWarning", "AttentionSpec", "__version__"]

"""Integrations of mlx-flash with other libraries.

Each integration is its own module, imported explicitly so that `import mlx_flash` never
imports (or requires) the library it integrates with:

    from mlx_flash.integrations import mlx_lm as flash_mlx_lm
    with flash_mlx_lm.patched():
        ...   # every mlx-lm model attends with mlx_flash.flash_attention
"""

"""attn_di's reference attention backends (need the ``attn_di[torch]`` extra)."""

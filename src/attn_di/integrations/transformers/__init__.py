"""Run attn_di's backends inside Hugging Face transformers models (``attn_di[transformers]``).

``register()`` adds the attention implementation ``"attn_di"`` (attn_di selects the backend
for each layer, through the container, on every call) and ``"attn_di:<MEMBER>"`` (that
member) to transformers; :class:`PagedCache` keeps the KV cache in the backend's paged
layout for ``model.generate``::

    from attn_di.integrations.transformers import PagedCache, register

    register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attn_di")
    model.generate(**inputs, cache=PagedCache(model.config), max_new_tokens=32)
"""

try:
    import transformers as _transformers  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess test
    from attn_di.exceptions import MissingExtraError

    raise MissingExtraError("transformers", "attn_di.integrations.transformers") from _exc

from attn_di.integrations.transformers._attention import AttentionFunction
from attn_di.integrations.transformers._paged_cache import PagedCache
from attn_di.integrations.transformers._registration import (
    ATTENTION_NAME,
    attention_settings,
    implementation_name,
    padding_mask,
    register,
)

__all__ = [
    "ATTENTION_NAME",
    "AttentionFunction",
    "PagedCache",
    "attention_settings",
    "implementation_name",
    "padding_mask",
    "register",
]

for _name in ("AttentionFunction", "PagedCache"):
    globals()[_name].__module__ = __name__
del _name

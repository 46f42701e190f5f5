"""attn_di: attention backends named, registered, selected, injected and tested."""

from attn_di.exceptions import AttnDIError

__all__ = ["AttnDIError"]

"""FLEX_ATTENTION: ``torch.nn.attention.flex_attention`` with a block mask from the metadata.

Keys and values are gathered from the paged cache into padded ``[b, H_kv, Lk, D]``
tensors; which key each query sees (sequence, causality, sliding window) becomes a
``BlockMask``; soft cap and ALiBi become a ``score_mod``; sinks are applied afterwards from
the returned log-sum-exp: with ``Z = exp(lse)``, ``out * Z / (Z + exp(sink))`` equals
``out * sigmoid(lse - sink)``.

Sinks need the log-sum-exp, which torch 2.13's compiled CPU kernel cannot return, so a
compiled impl refuses sinks.

Eager by default: on CPU torch then runs an unfused implementation and warns once per
process ("flex_attention called without torch.compile()"); attn_di silences exactly that
warning because eager is its deliberate default. Compiled mode (torch.compile of
``flex_attention``, fused kernels, a slow first call) is opted into by setting the
environment switch ``ATTN_DI_FLEX_COMPILE`` (``1``/``true``/``yes``/``on``; read when an impl is
created, anything but an on/off spelling refused), or ``FlexAttentionImpl.compile_default =
True``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.nn.attention import flex_attention as flex

from attn_di._env import Switch
from attn_di.backend._backend import AttentionBackend
from attn_di.backends._common import (
    SeqGroup,
)
from attn_di.backends._grouped import GroupedAttentionImpl, TorchCPUBackend
from attn_di.exceptions import UnsupportedFeatureError

__all__ = ["COMPILE_ENV_VAR", "COMPILE_SWITCH", "FlexAttentionBackend", "FlexAttentionImpl"]

COMPILE_ENV_VAR = "ATTN_DI_FLEX_COMPILE"
"""On (``1``, ``true``, ``yes``, ``on``): new impls run flex attention through ``torch.compile``."""
COMPILE_SWITCH = Switch(COMPILE_ENV_VAR, default=False, on="torch.compile", off="eager")
"""The switch itself (:class:`attn_di._env.Switch`), read when an impl is created."""

_EAGER_WARNING = r"flex_attention called without torch\.compile\(\)"


class FlexAttentionBackend(TorchCPUBackend):
    """Paged attention through torch's flex attention.

    Supports fp32/bf16/fp16, any head or block size, GQA/MQA, sliding window, soft cap,
    ALiBi and sinks; decoder, encoder and encoder-only attention. Forward only: backward
    through the eager CPU path is not supported (``supports_backward = False``).
    """

    supports_backward: ClassVar[bool] = False

    @staticmethod
    def get_name() -> str:
        """``"FLEX_ATTENTION"``."""
        return "FLEX_ATTENTION"

    @staticmethod
    def get_impl_cls() -> type[FlexAttentionImpl]:
        """:class:`FlexAttentionImpl`."""
        return FlexAttentionImpl

    @classmethod
    def supports_sink(cls) -> bool:
        """True: sinks are folded in through the log-sum-exp."""
        return True


class FlexAttentionImpl(GroupedAttentionImpl):
    """The FLEX_ATTENTION computation; see :class:`~attn_di.backend.AttentionImpl`.

    Attributes:
        compile_default: True: new impls use ``torch.compile`` whatever
            ``ATTN_DI_FLEX_COMPILE`` says (False by default: the switch decides).
        compiled: whether this impl uses ``torch.compile`` (fixed at construction).

    Raises:
        EnvSwitchError: ``ATTN_DI_FLEX_COMPILE`` holds something other than on/off (at
            construction).
    """

    backend: ClassVar[type[AttentionBackend]] = FlexAttentionBackend
    supports_alibi: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    compile_default: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compiled = type(self).compile_default or COMPILE_SWITCH.read()
        if self.compiled and self.sinks is not None:
            # torch 2.13's compiled CPU flex attention cannot return the log-sum-exp.
            raise UnsupportedFeatureError(
                "FLEX_ATTENTION", "sinks in compiled mode", ("CPU_ATTN", "TORCH_SDPA")
            )

    def _attend(
        self,
        query: torch.Tensor,
        key_src: torch.Tensor,
        value_src: torch.Tensor,
        group: SeqGroup,
    ) -> torch.Tensor:
        """``[b, H, Lq, D]`` attention of one group, in the query's dtype."""
        seqs, q_len = (int(n) for n in group.query_index.shape)
        k_len = int(group.kv_index.shape[1])
        queries = query[group.query_index].transpose(1, 2).contiguous()  # [b, H, Lq, D]
        keys = key_src[group.kv_index].transpose(1, 2).contiguous()  # [b, H_kv, Lk, D]
        values = value_src[group.kv_index].transpose(1, 2).contiguous()
        allowed = group.allowed

        def mask_mod(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return allowed[b, q_idx, kv_idx]

        block_mask = flex.create_block_mask(
            mask_mod, seqs, None, q_len, k_len, device=str(query.device)
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_EAGER_WARNING, category=UserWarning)
            result = _flex_fn(self.compiled)(
                queries,
                keys,
                values,
                score_mod=self._score_mod(group),
                block_mask=block_mask,
                scale=self.scale,
                enable_gqa=self.num_kv_heads != self.num_heads,
                return_aux=flex.AuxRequest(lse=True) if self.sinks is not None else None,
            )
        if self.sinks is None:
            attended: torch.Tensor = result
        else:
            attended, aux = result
            lse = aux.lse.float()  # [b, H, Lq], natural log
            sink = self.sinks.float().view(1, -1, 1)
            keep = torch.sigmoid(lse - sink).unsqueeze(-1)
            attended = (attended.float() * keep).to(query.dtype)
        return attended

    def _score_mod(self, group: SeqGroup) -> Callable[..., torch.Tensor] | None:
        """Soft cap then ALiBi as a flex ``score_mod``; None when neither is set."""
        cap = self.logits_soft_cap
        slopes = None
        if self.alibi_slopes is not None:
            device = group.kv_index.device
            slopes = torch.tensor(self.alibi_slopes, dtype=torch.float32, device=device)
        if cap is None and slopes is None:
            return None
        query_pos = group.query_pos

        def score_mod(
            score: torch.Tensor,
            b: torch.Tensor,
            h: torch.Tensor,
            q_idx: torch.Tensor,
            kv_idx: torch.Tensor,
        ) -> torch.Tensor:
            if cap is not None:
                score = torch.tanh(score / cap) * cap
            if slopes is not None:
                score = score + slopes[h] * (kv_idx - query_pos[b, q_idx])
            return score

        return score_mod


@functools.cache
def _flex_fn(compiled: bool) -> Callable[..., Any]:
    """``flex_attention``, or its ``torch.compile`` form (compiled once per process)."""
    if compiled:
        return torch.compile(flex.flex_attention, dynamic=False)
    return flex.flex_attention

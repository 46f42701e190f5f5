"""``_Backend``: vLLM's deprecated alias forwards to the enum and warns at the caller."""

from __future__ import annotations

import pytest

import attn_di
from attn_di import AttentionBackendEnum
from attn_di.exceptions import AttnDIDeprecationWarning


def test_attribute_access_forwards_and_warns() -> None:
    """_Backend.X is the member, with a DeprecationWarning pointing at this file."""
    with pytest.warns(DeprecationWarning, match="use attn_di.AttentionBackendEnum") as record:
        member = attn_di._Backend.FLASH_ATTN
    assert member is AttentionBackendEnum.FLASH_ATTN
    assert record[0].category is AttnDIDeprecationWarning
    assert record[0].filename == __file__


def test_item_access_and_iteration_forward_and_warn() -> None:
    """_Backend["X"] and iteration forward to the enum, each warning at the caller."""
    with pytest.warns(AttnDIDeprecationWarning) as item_record:
        member = attn_di._Backend["CUSTOM"]
    with pytest.warns(AttnDIDeprecationWarning) as iter_record:
        members = list(iter(attn_di._Backend))
    assert member is AttentionBackendEnum.CUSTOM
    assert members == list(AttentionBackendEnum)
    assert [w.filename for w in (*item_record, *iter_record)] == [__file__, __file__]


def test_methods_forward() -> None:
    """Class-level methods such as register are reachable through the alias."""
    with pytest.warns(AttnDIDeprecationWarning):
        register = attn_di._Backend.register
    assert register == AttentionBackendEnum.register


def test_class_level_uses_forward() -> None:
    """isinstance, __members__, membership and calls behave as on the enum, each warning."""
    member = AttentionBackendEnum.CUSTOM
    with pytest.warns(AttnDIDeprecationWarning):
        assert isinstance(member, attn_di._Backend)
    with pytest.warns(AttnDIDeprecationWarning):
        members = attn_di._Backend.__members__
    with pytest.warns(AttnDIDeprecationWarning):
        found = attn_di._Backend(AttentionBackendEnum.CPU_ATTN.value)
    with pytest.warns(AttnDIDeprecationWarning):
        contained = member in attn_di._Backend
    assert "CUSTOM" in members
    assert found is AttentionBackendEnum.CPU_ATTN
    assert contained

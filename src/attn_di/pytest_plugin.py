"""attn_di's pytest plugin: the ``attn_di_container`` and ``override_backend`` fixtures and
the ``@pytest.mark.attention_backend`` marker.

pytest loads it in every session through the ``pytest11`` entry point ``attn_di``, which
names the top-level module ``_attn_di_pytest``: loading it there imports nothing of attn_di,
so a malformed ``ATTN_DI_REGISTRATIONS`` inherited from the environment fails only the tests
that use attn_di's fixtures or marker, never a suite that does not use attn_di. This module
re-exports it (for ``-p attn_di.pytest_plugin`` and ``pytest_plugins = [...]``); see
:mod:`_attn_di_pytest` for the fixtures and the marker.
"""

from _attn_di_pytest import (
    MARKER,
    _attn_di_markers,
    attn_di_container,
    override_backend,
    pytest_configure,
)

__all__ = ["MARKER", "attn_di_container", "override_backend", "pytest_configure"]
_ = _attn_di_markers  # re-exported: pytest finds the autouse marker hook here too

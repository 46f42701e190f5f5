"""The conformance kit: any attention backend checked against the float64 reference over the
feature matrix, what it declares against what it does.

Three ways in, one engine:

- ``attn-di conform TARGET`` (the command; ``--full``, ``--json``, ``--markdown``,
  ``--seed``, ``--dtype``, ``--case``);
- ``pytest --attn-di-conform=TARGET`` (attn_di's pytest plugin collects the cells as tests);
- ``test_my_backend = conformance_tests(MyBackend)`` in a test module: one pytest test per
  cell, ids like ``bf16-gqa4-decode-len150-window50-block16``.

``TARGET`` is a backend class, an :class:`~attn_di.AttentionBackendEnum` member, a member
name (``"CPU_ATTN"``, a runtime member's too) or a class path
(``"my_pkg.attention:MyBackend"`` or dotted).

Each cell (a :class:`Case`) is run through the backend's own interface (a :class:`Driver`:
attn_di's for :class:`~attn_di.backend.AttentionBackend` classes), compared with
:func:`attn_di.reference.reference_attention` in float64 with a tolerance derived from the
dtype (:func:`tolerance_rule`), and ends in an :class:`Outcome`. See the guide
(``docs/guides/conformance.md``) for the matrix, the outcomes and the tolerance rule.

Importing this package does not import torch; running a cell does.
"""

from attn_di.conformance._case import BAD_INPUTS, CHECKS, DTYPES, GQA, KINDS, Case, Outcome
from attn_di.conformance._driver import Capabilities, Driver, register_driver
from attn_di.conformance._pytest import conformance_tests
from attn_di.conformance._report import CellResult, ConformanceReport
from attn_di.conformance._runner import plan_conformance, run_conformance
from attn_di.conformance._tolerance import tolerance_rule

__all__ = [
    "BAD_INPUTS",
    "CHECKS",
    "DTYPES",
    "GQA",
    "KINDS",
    "Capabilities",
    "Case",
    "CellResult",
    "ConformanceReport",
    "Driver",
    "Outcome",
    "conformance_tests",
    "plan_conformance",
    "register_driver",
    "run_conformance",
    "tolerance_rule",
]

for _name in __all__:
    _exported = globals()[_name]
    if isinstance(_exported, type) or callable(_exported):
        _exported.__module__ = __name__
del _name, _exported

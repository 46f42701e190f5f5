"""The ``attn-di`` command (also ``python -m attn_di``): list, select, run and conform backends.

``attn-di list`` shows every member, where its class comes from and whether it imports here;
``attn-di select`` shows which backend a configuration gets and why the others were refused;
``attn-di run`` runs a paged-attention batch through backends, checks it against a float64
reference and reports time, tokens/s and GB/s; ``attn-di conform`` checks a backend over the
conformance kit's feature matrix (:mod:`attn_di.conformance`). Errors print one line and a
hint, exit 2.
"""

from attn_di.cli._main import main

__all__ = ["main"]

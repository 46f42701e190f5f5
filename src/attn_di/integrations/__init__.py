"""Integrations of attn_di's backends into other libraries, one subpackage per library.

Each subpackage imports its library and needs the matching extra (``attn_di[transformers]``);
importing ``attn_di`` or this package imports none of them.
"""

"""Integrations with training frameworks (optional extras).

Each submodule imports its framework; import the one you use, e.g.
``from kaisa.integrations.lightning import KFACCallback``.
"""

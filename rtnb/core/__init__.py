"""Shared core: configuration, typed rank↔driver messages, values, small helpers.

Imports nothing of rtnb but ``rtnb.errors``; every other part may import it.
"""

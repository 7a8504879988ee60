"""The driver's bounded view of what the ranks report: series, progress, exporters.

Imports only ``rtnb.core`` and ``rtnb.errors``.
"""

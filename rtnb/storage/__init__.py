"""The run directory and everything in it: run.json, the journal, metrics and log
records, checkpoints and their manifests (local paths or object storage).

Imports only ``rtnb.core`` and ``rtnb.errors``: it runs on both sides.
"""

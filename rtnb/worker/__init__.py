"""What runs inside a rank: the Ray actor, the rank runtime (cell thread, stop
protocol, reports), output capture, the in-cell API and the Ray Train aliases.

Never imports ``rtnb.driver`` or ``rtnb.batch``: a rank process holds no driver code.
"""

"""The notebook's side: Session (a facade over the lifecycle state machine), the
worker group, cell streaming and the stop protocol, recovery and replay, checkpoint
commits, status, and the connection to Ray.
"""

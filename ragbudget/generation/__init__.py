"""Answers out: the Backend protocol, the local generator, batching, served engines, per-request room."""

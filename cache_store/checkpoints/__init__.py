"""Checkpoints on one node: the in-memory store, the disk tier, the signed state blob."""

"""Prefix hashing, the state blob format, checkpoint storage and index backends."""

"""Replica side: the llama.cpp engine, sequence slots, checkpoint policy and local state store."""

"""The OpenAI-compatible HTTP gateway: bodies, prompts, grammars, replies, errors."""

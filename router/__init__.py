"""The front of the house: `gateway/` speaks the OpenAI API, `routing/` picks the replica."""

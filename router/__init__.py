"""HTTP ingress (OpenAI API) and the prefix-aware Ray Serve request router."""

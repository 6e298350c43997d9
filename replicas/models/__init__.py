"""Model tooling: generated test models, the default model, model sources, checks."""

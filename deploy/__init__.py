"""Configuration, application builder and the `baton` command line."""

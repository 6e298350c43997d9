"""The replica side: a replica's Serve deployment, peer pulls and shipping, and below it the
llama.cpp engine (`engine/`), model tooling (`models/`), the wire types (`wire/`) and
telemetry (`telemetry/`)."""

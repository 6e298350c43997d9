"""Request routing: Baton's Ray Serve `RequestRouter`, its cost model, ledger and metrics."""

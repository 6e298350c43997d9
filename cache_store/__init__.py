"""The ground floor, below both the router and the replicas. Prefix states outside one
engine: `index/` says which replica holds which prefix, `checkpoints/` keeps them on a node
(memory, disk) and gives their signed wire format. What every room shares: `wire/` (what
crosses between gateway, router and replica) and `telemetry/` (traces, metrics, logs). The
hash chain, model fingerprint and background supervision sit at the root, below all."""

"""Prefix states outside one engine: `index/` says which replica holds which prefix,
`checkpoints/` keeps them on a node (memory, disk) and gives their signed wire format; the
hash chain, model fingerprint and background supervision sit at the root, below both."""

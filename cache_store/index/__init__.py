"""The cluster index of checkpoint hashes: the contract, its Redis and embedded backends, a local copy."""

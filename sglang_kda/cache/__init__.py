"""The KDA state-checkpoint radix cache: tree, pool, admission, eviction, integrity."""

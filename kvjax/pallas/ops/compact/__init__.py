"""Move the kept rows of K, V and positions into fixed-capacity buffers."""

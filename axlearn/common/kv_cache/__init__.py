"""Key/value caches for incremental decoding (`kv_cache.KVCache`)."""

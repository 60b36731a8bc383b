"""KV cache tiers (fornax/engine/kv/offload): bookkeeping units and end-to-end engine runs."""

"""KV cache tiers below the primary pool: host memory (tier 1) and disk (tier 2).

The primary pool (engine/kv) evicts a cached prefix block when it needs the room; without
tiers that block's K/V is gone and a later request with the same prefix recomputes it. With
tiers, evicted blocks are copied to a host-memory pool, and from there written to disk by a
background thread; a prefix that misses the primary pool is looked up in the tiers and loaded
back instead of recomputed. Preemption under KV pressure can swap a request's blocks to the
host pool instead of dropping them.

    connector.py   the interface the scheduler and the runner speak (vLLM's KV connector shape)
                   and the per-step transfer plan; torch-free
    host_index.py  tier 1's bookkeeping: hash -> slot, LRU, pins, swapped requests; torch-free
    disk_store.py  tier 2: checksummed, content-addressed chunk files, LRU-bounded, async writes
    host_pool.py   tier 1's tensors and the copies between them and the primary pool (torch)
    tiered.py      TieredConnector: both tiers behind the interface
"""

"""Stores with one copy: a CPU engine shares its KV memory read-only with its CacheWorker, which
copies stored blocks straight out of it into its matchable pages (``owner``: the worker's store
socket; ``engine``: the engine's side; ``memory``: sharing, mapping and the gather; ``protocol``:
the messages and the keying of committed blocks)."""

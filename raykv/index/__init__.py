"""The global prefix index (pure): its key table, per-worker prefix answers, and the sharded
digest -> {worker: tier} map that the IndexShard actors wrap. Builds on :mod:`raykv.core` only.
"""

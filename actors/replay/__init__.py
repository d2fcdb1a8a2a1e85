"""Replay backends (in-process CacheWorkers or a Ray deployment) and Ray's PrefixTree baseline."""

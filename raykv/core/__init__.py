"""The single-device cache: typed ids, errors, config, block keys, pages, the radix tree, tiers,
eviction, placement, copies, the CacheManager and a request's KvCache, export/import, invariants.

Nothing here imports raykv's other sub-packages; the layers inside are checked by import-linter
(see pyproject.toml). Public names are re-exported by :mod:`raykv`.
"""

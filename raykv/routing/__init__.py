"""Routing (pure): the cost model that picks a worker from the index's prefix answers and load,
and prefill/decode pairing. Builds on :mod:`raykv.core` and :mod:`raykv.index`.
"""

"""Ending a Ray session that this process started, without Ray ending the process.

Ray's core worker exits the whole process (status 1, no message) when a thread touches it after
``ray.shutdown()`` (ray-project/ray#19115). A cyclic garbage object holding an ActorHandle or an
ObjectRef does exactly that when the cycle collector happens to run later in some other thread (a
UCX or transfer thread), so the garbage goes first, while Ray is still up. For the same reason
the liveness threads (:class:`actors.cache.liveness.Pinger`) stop first.
"""

from __future__ import annotations

import gc
import time

import ray

from actors.cache.liveness import stop_all


def shutdown_ray(settle_s: float = 0.2) -> None:
    """Stop the liveness threads, collect garbage (and let the last actor-death notices arrive),
    then ``ray.shutdown()``."""
    stop_all()
    gc.collect()
    time.sleep(settle_s)
    gc.collect()
    ray.shutdown()

"""Ray Serve: the cache-aware router, model replicas and PD proxies, Ray Serve LLM apps, and what
a replica announces to routers."""

"""The cache's actors: CacheWorker, index shards and their client, page transfers through Ray,
metrics, liveness, the deployment's settings and bringing a deployment up (``cluster``)."""

"""The vLLM connector's line to a deployment through Ray: the link and its off-thread lookups."""

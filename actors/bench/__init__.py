"""The Ray-side benchmarks of ``raykv bench``: index, Serve, vLLM, scheduler, soak, and which
suites this machine can run."""

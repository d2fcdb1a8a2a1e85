"""Engine adapters: move an inference engine's KV cache to and from raykv pages.

Each adapter imports its engine lazily (inside functions), so importing ``raykv`` or this package
never imports torch or transformers, and no adapter imports ray.

- :mod:`raykv.integrations.hf`: Hugging Face transformers cache objects (``DynamicCache``).
- :mod:`raykv.integrations.vllm`: ``RaykvConnector``, a vLLM (V1) KV connector.
"""

"""``with_raykv``: what it puts in a user's ``LLMConfig`` (no Ray cluster needed)."""

from __future__ import annotations

import pytest
from deps import require

require("ray.llm")

from ray.serve.llm import LLMConfig  # noqa: E402

from actors.serve.llm import RaykvLLMServer, with_raykv  # noqa: E402
from raykv import ConfigError  # noqa: E402


def _config(**engine: object) -> LLMConfig:
    return LLMConfig(
        model_loading_config={"model_id": "m", "model_source": "/models/m"}, engine_kwargs=engine
    )


def test_a_raykv_failure_never_fails_a_request() -> None:
    """vLLM's default ``kv_load_failure_policy`` fails a request whose load fails; with_raykv
    recomputes instead, and keeps the user's extra config."""
    user = {"kv_transfer_config": {"kv_connector_extra_config": {"inbox_bytes": 1 << 20}}}
    original = _config(**user)
    served = with_raykv(original, namespace="ns", timeout_s=4.0)
    transfer = served.engine_kwargs["kv_transfer_config"]
    assert transfer["kv_load_failure_policy"] == "recompute"
    assert transfer["kv_connector"] == "RaykvConnector" and transfer["kv_role"] == "kv_both"
    assert transfer["kv_connector_extra_config"] == {
        "inbox_bytes": 1 << 20,
        "timeout_s": 4.0,
        "namespace": "ns",
    }
    assert served.server_cls is RaykvLLMServer
    assert original.engine_kwargs == user  # the original is not changed


def test_another_connector_is_refused() -> None:
    with pytest.raises(ConfigError):
        with_raykv(_config(kv_transfer_config={"kv_connector": "NixlConnector"}))


def test_routers_key_requests_as_the_replicas_engines_do() -> None:
    """A replica announces its engine's block size and model fingerprint (replica metadata once
    its engine bound, routing stats after); the router keys with the one scheme they share,
    falls back to load when they disagree, and to the deployment's block size when none told."""
    from types import SimpleNamespace

    from actors.serve.fields import KEYS_FIELD, key_scheme, keys_of

    model = bytes(range(32))

    def replica(meta: object = None, stats: object = None) -> SimpleNamespace:
        return SimpleNamespace(replica_metadata=meta or {}, routing_stats=stats or {})

    told = replica({KEYS_FIELD: [32, model.hex()]})
    later = replica(stats={KEYS_FIELD: [32, model.hex()]})
    assert keys_of(told) == keys_of(later) == (32, model)
    assert (
        keys_of(replica({KEYS_FIELD: [32, "zz"]})) is None
        and keys_of(replica({KEYS_FIELD: [0, model.hex()]})) is None
    )
    assert key_scheme([told, later, replica()]) == (32, model)
    assert key_scheme([replica(), replica()]) is None
    assert key_scheme([told, replica({KEYS_FIELD: [16, model.hex()]})]) is False

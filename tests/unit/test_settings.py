"""The configuration file (actors/cache/settings.py) and ``raykv config``: TOML and RAYKV_* overrides
validated into the config classes ``start()`` takes; errors name the key and what is allowed."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from actors.cache.settings import (
    NODE_IP,
    DeploymentConfig,
    Settings,
    defaults_toml,
    load_settings,
    parse_size,
    settings_from_dict,
)
from actors.cli.main import main
from raykv import CacheConfig, KVLayout, TierConfig
from raykv.core.errors import ConfigError
from raykv.routing.policy import RoutingConfig
from raykv.transfer import TransferConfig

ROOT = Path(__file__).resolve().parents[2]

FULL = """
[deployment]
namespace = "prod"
num_workers = 2
index_shards = 3
max_restarts = -1
worker_resources = [{node0 = 0.01}, {node1 = 0.5}]

[layout]
num_layers = 4
num_kv_heads = 2
head_dim = 64
tokens_per_block = 32
dtype = "bfloat16"

[cache]
max_util_for_resume = 0.9
max_blocks_per_salt = 1000

[tiers.disk]
capacity = "1 GiB"
path = "{disk}"

[tiers.host]
capacity = 1048576
shared = true

[transfer]
host = "10.0.0.5"
timeout_s = 30
ucx_progress = "blocking"

[routing]
w_host = 0.8
allow_pulls = true
"""


def test_printed_defaults_load_back_to_the_defaults_start_uses() -> None:
    text = defaults_toml()
    settings = settings_from_dict(tomllib.loads(text))
    assert settings == Settings() == load_settings(None, {})
    assert settings.cache is None  # start() then picks default_config(use_gpu)
    assert settings.deployment == DeploymentConfig("raykv", None, 1, 0, ())
    assert settings.transfer == TransferConfig(host=NODE_IP)
    assert settings.routing == RoutingConfig()
    for section in ("[deployment]", "[transfer]", "[routing]", "# [tiers.host]", "# [layout]"):
        assert section in text


def test_a_full_file_becomes_the_config_classes(tmp_path: Path) -> None:
    path = tmp_path / "raykv.toml"
    path.write_text(FULL.replace("{disk}", str(tmp_path)))
    s = load_settings(path, {})
    layout = KVLayout.uniform(
        num_layers=4, num_kv_heads=2, head_dim=64, tokens_per_block=32, dtype="bfloat16"
    )
    tiers = (TierConfig.host(1 << 20, shared=True), TierConfig.disk(1 << 30, path=str(tmp_path)))
    assert s.cache == CacheConfig(layout, tiers, max_util_for_resume=0.9, max_blocks_per_salt=1000)
    assert s.deployment == DeploymentConfig("prod", 2, 3, -1, ({"node0": 0.01}, {"node1": 0.5}))
    assert s.transfer == TransferConfig(host="10.0.0.5", timeout_s=30.0, ucx_progress="blocking")
    assert s.routing == RoutingConfig(tokens_per_block=32, w_host=0.8, allow_pulls=True)


def test_an_mla_layout_from_latent_size() -> None:
    """``latent_size`` above 0 lays the deployment out for an MLA engine: one latent per token and
    layer, as its connector derives it."""
    from raykv.integrations.vllm.layout import mla_layout

    doc = {
        "layout": {"num_layers": 61, "latent_size": 576, "tokens_per_block": 64, "dtype": "bfloat16"},
        "tiers": {"host": {"capacity": 1 << 30}},
    }
    cache = settings_from_dict(doc).cache
    assert cache is not None and cache.layout == mla_layout(61, 576, 64, "bfloat16")


def test_environment_overrides_win_and_other_raykv_variables_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "raykv.toml"
    path.write_text(FULL.replace("{disk}", str(tmp_path)))
    env = {
        "RAYKV_DEPLOYMENT__NUM_WORKERS": "3",
        "RAYKV_DEPLOYMENT__WORKER_RESOURCES": "[{a = 1}, {b = 1}, {c = 1}]",
        "RAYKV_TIERS__HOST__CAPACITY": "2MiB",
        "RAYKV_TRANSFER__HOST": "10.0.0.9",
        "RAYKV_ROUTING__ALLOW_PULLS": "false",
        "RAYKV_PURE_INDEX": "1",  # not a setting: no double underscore
        "RAYKV_TRANSFER_TOKEN": "00ff",
        "OTHER__X": "1",
    }
    s = load_settings(path, env)
    assert s.deployment.num_workers == 3
    assert s.deployment.worker_resources == ({"a": 1}, {"b": 1}, {"c": 1})
    assert s.cache is not None and s.cache.tiers[0] == TierConfig.host(2 << 20, shared=True)
    assert s.transfer.host == "10.0.0.9" and s.transfer.timeout_s == 30.0
    assert s.routing.allow_pulls is False and s.routing.w_host == 0.8
    assert load_settings(None, {"RAYKV_TIERS__HOST__CAPACITY": "64MiB"}).cache == CacheConfig(
        KVLayout.uniform(num_layers=8, num_kv_heads=8, head_dim=128), (TierConfig.host(64 << 20),)
    )


@pytest.mark.parametrize(
    ("doc", "field", "words"),
    [
        ({"transfer": {"timeout": 3}}, "transfer.timeout", ["unknown key", "timeout_s", "connect_timeout_s"]),
        ({"transfer": {"port": "80"}}, "transfer.port", ["must be an integer", "'80'"]),
        ({"transfer": {"port": 70000}}, "transfer.port", ["0..65535"]),
        ({"transfer": {"ucx_progress": "fast"}}, "transfer.ucx_progress", ["thread", "blocking"]),
        ({"routing": {"w_gpu": 2.0}}, "routing.w_gpu", ["[0, 1]"]),
        ({"routing": {"tokens_per_block": 8}}, "routing.tokens_per_block", ["unknown key"]),
        ({"routing": {"allow_pulls": 1}}, "routing.allow_pulls", ["true or false"]),
        (
            {"layout": {"dtype": "fp4"}, "tiers": {"host": {"capacity": 1 << 30}}},
            "layout.dtype",
            ["bfloat16"],
        ),
        ({"layout": {"heads": 2}, "tiers": {"host": {"capacity": 1}}}, "layout.heads", ["num_kv_heads"]),
        ({"layout": {"num_layers": 4}}, "tiers", ["[tiers.host]"]),
        (
            {"layout": {"latent_size": 576, "head_dim": 64}, "tiers": {"host": {"capacity": 1 << 30}}},
            "layout.latent_size",
            ["no head_dim"],
        ),
        (
            {"layout": {"latent_size": -1}, "tiers": {"host": {"capacity": 1 << 30}}},
            "layout.latent_size",
            [">= 0"],
        ),
        ({"tiers": {"ssd": {"capacity": 1}}}, "tiers.ssd", ["gpu, host, disk"]),
        ({"tiers": {"host": {"capacity": "lots"}}}, "tiers.host.capacity", ["512MiB"]),
        ({"tiers": {"host": {"size": 1}}}, "tiers.host.size", ["capacity", "pin_memory", "shared"]),
        ({"tiers": {"host": {"shared": True}}}, "tiers.host.capacity", ["required"]),
        ({"tiers": {"host": {"capacity": 10}}}, "tiers.host.capacity", ["less than one page"]),
        (
            {"cache": {"max_events": 0}, "tiers": {"host": {"capacity": 1 << 30}}},
            "cache.max_events",
            ["positive"],
        ),
        ({"deployment": {"num_workers": 0}}, "deployment.num_workers", [">= 1"]),
        ({"deployment": {"index_shards": 0}}, "deployment.index_shards", [">= 1"]),
        ({"deployment": {"max_restarts": -2}}, "deployment.max_restarts", [">= -1"]),
        (
            {"deployment": {"num_workers": 2, "worker_resources": [{"a": 1}]}},
            "deployment.worker_resources",
            ["1 entries for 2 workers"],
        ),
        ({"deployment": {"worker_resources": [{"a": -1}]}}, "deployment.worker_resources", ["> 0"]),
        ({"deploy": {}}, "deploy", ["deployment", "transfer", "routing"]),
        ({"transfer": 3}, "transfer", ["table"]),
    ],
)
def test_a_bad_value_names_the_key_and_what_is_allowed(doc: dict, field: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict(doc)
    assert info.value.field == field
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_bad_environment_and_files_name_the_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, {"RAYKV_TRANSFR__HOST": "x"})
    assert info.value.field == "RAYKV_TRANSFR__HOST" and "deployment" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_settings(None, {"RAYKV_TRANSFER__TIMEOUT_S": "soon"})
    assert info.value.field == "transfer.timeout_s"
    with pytest.raises(ConfigError) as info:
        load_settings(tmp_path / "missing.toml", {})
    assert info.value.field == "config" and "missing.toml" in str(info.value)
    bad = tmp_path / "bad.toml"
    bad.write_text("[deployment\n")
    with pytest.raises(ConfigError) as info:
        load_settings(bad, {})
    assert info.value.field == "config" and "not valid TOML" in str(info.value)


def test_sizes() -> None:
    assert parse_size("x", "512MiB") == 512 << 20
    assert parse_size("x", "2 GiB") == 2 << 30
    assert parse_size("x", "1.5GB") == 1_500_000_000
    assert parse_size("x", "4096") == 4096
    assert parse_size("x", 7) == 7
    for bad in ("1 PiB", "-1MiB", "", True, 1.5):
        with pytest.raises(ConfigError):
            parse_size("x", bad)


def test_deployment_config_is_frozen_and_checked_again_on_replace() -> None:
    d = DeploymentConfig(num_workers=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.num_workers = 3  # type: ignore[misc]
    with pytest.raises(ConfigError):
        dataclasses.replace(d, index_shards=0)


def test_raykv_config_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--print-defaults"]) == 0
    printed = capsys.readouterr().out
    assert printed == defaults_toml()
    good = tmp_path / "good.toml"
    good.write_text(printed)
    assert main(["config", "--check", str(good)]) == 0
    assert "valid" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text("[transfer]\nport = -1\n")
    assert main(["config", "--check", str(bad)]) == 1
    assert "transfer.port" in capsys.readouterr().err


def test_up_with_a_bad_config_fails_before_touching_ray(tmp_path: Path) -> None:
    """A separate process: the error is one line, exit 1, and Ray was never imported."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[deployment]\nindex_shards = 0\n")
    code = (
        "import sys; from actors.cli.main import main; rc = main(['up', '--config', sys.argv[1]]);"
        "assert 'ray' not in sys.modules, 'ray imported'; sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(bad)], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == "raykv: deployment.index_shards: must be an int >= 1, got 0"

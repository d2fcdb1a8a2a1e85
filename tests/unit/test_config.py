"""KVLayout arithmetic and lookups; CacheConfig / TierConfig validation, replace, pickling."""

from __future__ import annotations

import dataclasses
import math
import os
import pickle

import pytest

from raykv.core.config import BufferSpec, CacheConfig, KVLayout, LayerSpec, TierConfig
from raykv.core.errors import ConfigError, NotFoundError, RoleNotFoundError
from raykv.core.types import TierKind


def small_layout(tpb: int = 4) -> KVLayout:
    return KVLayout.uniform(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=tpb)


def page(layout: KVLayout | None = None) -> int:
    return (layout or small_layout()).page_bytes


def make_config(**changes) -> CacheConfig:
    layout = changes.pop("layout", small_layout())
    tiers = changes.pop("tiers", (TierConfig.host(10 * layout.page_bytes),))
    return CacheConfig(layout=layout, tiers=tiers, **changes)


def assert_config_error(exc_info, field: str) -> None:
    err = exc_info.value
    assert isinstance(err, ConfigError) and isinstance(err, ValueError)
    assert err.field == field
    assert field in str(err)


# ----------------------------------------------------------------------------- KVLayout
def test_uniform_page_bytes_matches_design_formula():
    layers, heads, dim, tpb = 4, 8, 128, 16
    layout = KVLayout.uniform(layers, heads, dim, tokens_per_block=tpb, dtype="bfloat16")
    assert layout.page_bytes == 2 * layers * heads * dim * tpb * 2 == 262144
    assert layout.tokens_per_block == tpb
    assert layout.layer_ids == (0, 1, 2, 3)
    for layer in range(layers):
        assert layout.roles(layer) == ("k", "v")
    k0 = layout.buffer_region(0, "k")
    assert (k0.offset, k0.nbytes, k0.view_shape) == (0, 32768, (16, 8, 128))
    assert layout.buffer_region(3, "v").offset == 7 * 32768


def test_float32_and_fp8_dtypes():
    f32 = KVLayout.uniform(1, 2, 4, tokens_per_block=4, dtype="float32")
    assert f32.page_bytes == 2 * 2 * 4 * 4 * 4
    fp8 = KVLayout.uniform(1, 2, 4, tokens_per_block=4, dtype="float8_e4m3fn")
    assert fp8.page_bytes == 2 * 2 * 4 * 4 * 1
    assert fp8.buffer_region(0, "k").spec.itemsize == 1


def test_padding_each_region_to_16_bytes():
    # k/v region: 3 tokens * 3 heads * 5 dim * 2 bytes = 90 -> padded to 96
    # k_scale region: 3 tokens * 2 * 4 bytes = 24 -> padded to 32
    extra = (BufferSpec("k_scale", (2,), "float32"),)
    layout = KVLayout.uniform(2, 3, 5, tokens_per_block=3, dtype="float16", extra=extra)
    assert layout.page_bytes == 2 * (96 + 96 + 32) == 448
    assert layout.roles(0) == ("k", "v", "k_scale")
    assert layout.roles(1) == ("k", "v", "k_scale")
    expected = [
        (0, "k", 0, 90),
        (0, "v", 96, 90),
        (0, "k_scale", 192, 24),
        (1, "k", 224, 90),
        (1, "v", 320, 90),
        (1, "k_scale", 416, 24),
    ]
    got = [(r.layer_id, r.spec.role, r.offset, r.nbytes) for r in layout.regions()]
    assert got == expected
    for layer_id, role, offset, nbytes in expected:
        region = layout.buffer_region(layer_id, role)
        assert (region.offset, region.nbytes) == (offset, nbytes)
    ks = layout.buffer_region(1, "k_scale")
    assert ks.view_shape == (3, 2) and ks.spec.dtype == "float32"


def test_regions_in_order_non_overlapping_aligned():
    extra = (BufferSpec("k_scale", (3,), "float32"), BufferSpec("index_k", (1, 7), "int8"))
    layout = KVLayout.uniform(3, 1, 3, tokens_per_block=5, dtype="float16", extra=extra)
    regions = layout.regions()
    assert len(regions) == 3 * 4
    end = 0
    for r in regions:
        assert r.offset % 16 == 0
        assert r.offset >= end
        assert r.offset - end < 16  # only padding between regions
        assert r.nbytes == r.tokens_per_block * math.prod(r.spec.shape) * r.spec.itemsize
        end = r.offset + r.nbytes
    assert layout.page_bytes == -(-end // 16) * 16
    assert layout.page_bytes % 16 == 0


def test_non_uniform_layout_ids():
    layers = (
        LayerSpec(5, (BufferSpec("k", (2, 4)), BufferSpec("v", (2, 4)))),
        LayerSpec(9, (BufferSpec("kv", (1, 8), "float32"),)),
    )
    layout = KVLayout(layers=layers, tokens_per_block=2)
    assert layout.layer_ids == (5, 9)
    assert layout.roles(9) == ("kv",)
    assert layout.buffer_region(9, "kv").offset == 32 + 32
    assert layout.page_bytes == 32 + 32 + 64


@pytest.mark.parametrize("layer_id, role", [(0, "q"), (0, "K"), (2, "k"), (-1, "v"), ("0", "k"), (0, None)])
def test_buffer_region_unknown(layer_id, role):
    layout = small_layout()
    with pytest.raises(RoleNotFoundError) as info:
        layout.buffer_region(layer_id, role)
    err = info.value
    assert isinstance(err, KeyError) and isinstance(err, NotFoundError)
    assert err.layer_id == layer_id and err.role == role
    assert str(err) == err.message and not str(err).startswith(("'", '"'))


def test_buffer_region_unhashable_role():
    with pytest.raises(RoleNotFoundError):
        small_layout().buffer_region(0, ["k"])


@pytest.mark.parametrize("layer_id", [2, -1, 100, "0", None])
def test_roles_unknown_layer(layer_id):
    with pytest.raises(RoleNotFoundError) as info:
        small_layout().roles(layer_id)
    assert isinstance(info.value, KeyError) and isinstance(info.value, NotFoundError)
    with pytest.raises(KeyError):
        small_layout().roles(layer_id)


def test_layout_value_semantics_and_pickle():
    a = KVLayout.uniform(2, 3, 5, tokens_per_block=3, extra=(BufferSpec("k_scale", (2,), "float32"),))
    b = KVLayout.uniform(2, 3, 5, tokens_per_block=3, extra=(BufferSpec("k_scale", (2,), "float32"),))
    assert a == b and hash(a) == hash(b)
    assert a != KVLayout.uniform(2, 3, 5, tokens_per_block=4)
    c = pickle.loads(pickle.dumps(a))
    assert c == a and c.page_bytes == 448
    assert c.buffer_region(1, "k_scale").offset == 416
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.tokens_per_block = 8  # type: ignore[misc]


def test_layout_structure_errors():
    with pytest.raises(ConfigError) as info:
        KVLayout(layers=(), tokens_per_block=4)
    assert_config_error(info, "layers")
    lay = LayerSpec(0, (BufferSpec("k", (1,)),))
    with pytest.raises(ConfigError) as info:
        KVLayout(layers=(lay, lay), tokens_per_block=4)
    assert_config_error(info, "layers")
    with pytest.raises(ConfigError) as info:
        LayerSpec(0, (BufferSpec("k", (1,)), BufferSpec("k", (2,))))
    assert_config_error(info, "buffers")
    with pytest.raises(ConfigError) as info:
        BufferSpec("k", (0, 4))
    assert_config_error(info, "shape")
    with pytest.raises(ConfigError) as info:
        KVLayout.uniform(0, 2, 8)
    assert_config_error(info, "num_layers")


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("tpb", [0, -1, -16, True, 1.5])
def test_tokens_per_block_invalid(tpb):
    with pytest.raises(ConfigError) as info:
        KVLayout.uniform(2, 2, 8, tokens_per_block=tpb)
    assert_config_error(info, "tokens_per_block")
    with pytest.raises(ConfigError) as info:
        KVLayout(layers=small_layout().layers, tokens_per_block=tpb)
    assert_config_error(info, "tokens_per_block")


@pytest.mark.parametrize("util", [0, 0.0, -0.1, 1.1, 2, float("nan"), float("inf"), True, "0.5", None])
def test_max_util_for_resume_invalid(util):
    with pytest.raises(ConfigError) as info:
        make_config(max_util_for_resume=util)
    assert_config_error(info, "max_util_for_resume")


@pytest.mark.parametrize("util", [1.0, 1, 0.5, 1e-9])
def test_max_util_for_resume_valid(util):
    assert make_config(max_util_for_resume=util).max_util_for_resume == util


@pytest.mark.parametrize("capacity", [0, -1, -4096, 1.5, True, None])
@pytest.mark.parametrize("factory", [TierConfig.gpu, TierConfig.host, TierConfig.disk])
def test_tier_capacity_invalid(factory, capacity):
    with pytest.raises(ConfigError) as info:
        factory(capacity)
    assert_config_error(info, "capacity_bytes")


def test_tier_smaller_than_a_page():
    layout = small_layout()
    with pytest.raises(ConfigError) as info:
        make_config(layout=layout, tiers=(TierConfig.host(layout.page_bytes - 1),))
    assert_config_error(info, "capacity_bytes")
    with pytest.raises(ConfigError) as info:
        make_config(layout=layout, tiers=(TierConfig.host(10 * page()), TierConfig.disk(page() - 1)))
    assert_config_error(info, "capacity_bytes")
    ok = make_config(layout=layout, tiers=(TierConfig.host(layout.page_bytes),))
    assert ok.tiers[0].num_pages(layout.page_bytes) == 1
    assert TierConfig.host(10 * page() + 5).num_pages(page()) == 10


@pytest.mark.parametrize("dtype", ["float64", "fp16", "FLOAT16", "", "torch.float16"])
def test_unknown_dtype(dtype):
    with pytest.raises(ConfigError) as info:
        BufferSpec("k", (2, 8), dtype)
    assert_config_error(info, "dtype")
    with pytest.raises(ConfigError) as info:
        KVLayout.uniform(2, 2, 8, dtype=dtype)
    assert_config_error(info, "dtype")


def test_duplicate_tier_kinds():
    with pytest.raises(ConfigError) as info:
        make_config(tiers=(TierConfig.host(10 * page()), TierConfig.host(10 * page())))
    assert_config_error(info, "tiers")


@pytest.mark.parametrize(
    "kinds",
    [("disk", "host"), ("host", "gpu"), ("disk", "gpu"), ("gpu", "disk", "host")],
)
def test_wrong_tier_order(kinds):
    tiers = tuple(TierConfig(kind, 10 * page()) for kind in kinds)
    with pytest.raises(ConfigError) as info:
        make_config(tiers=tiers)
    assert_config_error(info, "tiers")


def test_right_tier_order_and_no_tiers():
    tiers = tuple(TierConfig(kind, 10 * page()) for kind in ("gpu", "host", "disk"))
    cfg = make_config(tiers=tiers)
    assert [t.kind for t in cfg.tiers] == [TierKind.GPU, TierKind.HOST, TierKind.DISK]
    with pytest.raises(ConfigError) as info:
        make_config(tiers=())
    assert_config_error(info, "tiers")


def test_tier_kind_parsing():
    assert TierConfig("host", 100).kind is TierKind.HOST
    assert TierConfig("DISK", 100).kind is TierKind.DISK
    with pytest.raises(ConfigError) as info:
        TierConfig("ssd", 100)
    assert_config_error(info, "kind")


def test_disk_path_missing(tmp_path):
    with pytest.raises(ConfigError) as info:
        TierConfig.disk(10 * page(), path=str(tmp_path / "does-not-exist"))
    assert_config_error(info, "path")
    a_file = tmp_path / "file"
    a_file.write_bytes(b"x")
    with pytest.raises(ConfigError) as info:
        TierConfig.disk(10 * page(), path=str(a_file))
    assert_config_error(info, "path")
    assert TierConfig.disk(10 * page(), path=str(tmp_path)).path == str(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to a read-only directory")
def test_disk_path_not_writable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ConfigError) as info:
            TierConfig.disk(10 * page(), path=str(ro))
        assert_config_error(info, "path")
    finally:
        ro.chmod(0o700)


def test_path_only_on_disk_tier(tmp_path):
    with pytest.raises(ConfigError) as info:
        TierConfig(TierKind.HOST, 10 * page(), path=str(tmp_path))
    assert_config_error(info, "path")


@pytest.mark.parametrize("bad", [0, -1, True])
def test_max_events_invalid(bad):
    with pytest.raises(ConfigError) as info:
        make_config(max_events=bad)
    assert_config_error(info, "max_events")


# ----------------------------------------------------------------------------- replace, pickle
def test_replace_cache_config_revalidates():
    cfg = make_config(max_util_for_resume=0.9)
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(cfg, max_util_for_resume=1.5)
    assert_config_error(info, "max_util_for_resume")
    with pytest.raises(ConfigError) as info:
        cfg.replace(max_events=0)
    assert_config_error(info, "max_events")
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(cfg, tiers=(TierConfig.disk(10 * page()), TierConfig.host(10 * page())))
    assert_config_error(info, "tiers")
    assert cfg.max_util_for_resume == 0.9  # unchanged after rejected calls

    new = dataclasses.replace(cfg, max_util_for_resume=0.5)
    assert new.max_util_for_resume == 0.5
    assert (new.layout, new.tiers, new.max_events) == (cfg.layout, cfg.tiers, cfg.max_events)
    assert new != cfg
    assert dataclasses.replace(new, max_util_for_resume=0.9) == cfg
    assert cfg.replace(max_events=7) == dataclasses.replace(cfg, max_events=7)
    assert cfg.replace(max_events=7).max_events == 7


def test_replace_tier_config_revalidates(tmp_path):
    tier = TierConfig.disk(10 * page(), path=str(tmp_path))
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(tier, capacity_bytes=0)
    assert_config_error(info, "capacity_bytes")
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(tier, path=str(tmp_path / "missing"))
    assert_config_error(info, "path")
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(tier, kind=TierKind.HOST)  # host with a path
    assert_config_error(info, "path")
    bigger = dataclasses.replace(tier, capacity_bytes=20 * page())
    assert bigger.capacity_bytes == 20 * page()
    assert (bigger.kind, bigger.path, bigger.device) == (tier.kind, tier.path, tier.device)
    assert bigger != tier
    assert dataclasses.replace(bigger, capacity_bytes=10 * page()) == tier


def test_configs_pickle_and_compare_by_value(tmp_path):
    def build():
        layout = KVLayout.uniform(
            2, 3, 5, tokens_per_block=3, extra=(BufferSpec("k_scale", (2,), "float32"),)
        )
        tiers = (
            TierConfig.gpu(8 * layout.page_bytes, device=1),
            TierConfig.host(16 * layout.page_bytes, pin_memory=False),
            TierConfig.disk(32 * layout.page_bytes, path=str(tmp_path)),
        )
        return CacheConfig(layout=layout, tiers=tiers, max_util_for_resume=0.75, max_events=64)

    a, b = build(), build()
    assert a == b and a is not b
    assert hash(a) == hash(b)
    assert a.tokens_per_block == 3
    for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
        c = pickle.loads(pickle.dumps(a, protocol=proto))
        assert c == a
        assert c.layout.page_bytes == 448
        assert c.tiers[2].path == str(tmp_path) and c.tiers[1].pin_memory is False
        assert c.tiers[0].device == 1 and c.tiers[0].kind is TierKind.GPU
    assert TierConfig.host(4096) == TierConfig.host(4096)
    assert TierConfig.host(4096) != TierConfig.host(4096, pin_memory=False)
    assert pickle.loads(pickle.dumps(TierConfig.host(4096))) == TierConfig.host(4096)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.max_events = 5  # type: ignore[misc]

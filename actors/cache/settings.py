"""One configuration file for a deployment: TOML plus ``RAYKV_*`` environment overrides.

``load_settings(path, environ)`` reads an optional TOML file, applies environment overrides and
validates everything into the existing frozen config classes: :class:`DeploymentConfig` (what
``start()`` takes besides the configs), :class:`raykv.core.config.CacheConfig` (from ``[layout]``,
``[cache]`` and ``[tiers.gpu|host|disk]``), :class:`raykv.transfer.TransferConfig` and
:class:`raykv.routing.policy.RoutingConfig`. ``raykv up`` passes the result to ``start()``.

Environment overrides are named ``RAYKV_<SECTION>__<KEY>`` (double underscores between the
parts, so ``RAYKV_PURE_INDEX`` and the like are never read as overrides), e.g.
``RAYKV_DEPLOYMENT__NUM_WORKERS=4``, ``RAYKV_TIERS__HOST__CAPACITY=8GiB``,
``RAYKV_TRANSFER__TIMEOUT_S=60``. A value is read as a TOML value when it parses as one (``4``,
``true``, ``[{node0 = 1}]``), else as a string; an override wins over the file.

Every bad input raises :class:`raykv.core.errors.ConfigError` whose ``field`` is the dotted key
(``transfer.timeout_s``) and whose message gives the allowed keys or values; nothing is started.
This module never imports Ray (the CLI's parser builds without it).
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raykv.core.config import DTYPES, CacheConfig, KVLayout, TierConfig
from raykv.core.errors import ConfigError, InvalidArgumentError
from raykv.core.types import TierKind
from raykv.routing.policy import DEFAULT_ROUTING, RoutingConfig
from raykv.transfer import TransferConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

NODE_IP = "node-ip"
"""``transfer.host`` default: each page server binds its worker's node IP (127.0.0.1 when every
Ray node runs on one machine; see ``actors.cache.transfer.actor_transfer_config``)."""

ENV_PREFIX = "RAYKV_"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


@dataclass(frozen=True)
class DeploymentConfig:
    """``start()``'s deployment arguments, validated.

    ``namespace``: the Ray namespace of the actors. ``num_workers``: None for one worker per GPU
    (2 CPU workers on a cluster without GPUs), else that many CPU workers. ``index_shards`` >= 1.
    ``max_restarts`` >= -1 (-1: without limit) for the workers. ``worker_resources``: per worker
    i, custom Ray resources it needs (e.g. ``{"node1": 0.01}`` to pin it to a node); empty: none.
    ``index_capacity`` >= 0: the keys the index is expected to hold (all shards together): each
    shard's table is sized for its part up front and never grows until that is passed; 0: tables
    start small and grow 2x as needed (a few slots per write; docs/design.md "Events and index shards").
    """

    namespace: str = "raykv"
    num_workers: int | None = None
    index_shards: int = 1
    max_restarts: int = 0
    worker_resources: tuple[dict[str, float], ...] = ()
    index_capacity: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ConfigError("namespace", f"must be a non-empty str, got {self.namespace!r}")
        n = self.num_workers
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError("num_workers", f"must be an int >= 1 (omit it: one per GPU), got {n!r}")
        if isinstance(self.index_shards, bool) or not isinstance(self.index_shards, int):
            raise ConfigError("index_shards", f"must be an int >= 1, got {self.index_shards!r}")
        if self.index_shards < 1:
            raise ConfigError("index_shards", f"must be an int >= 1, got {self.index_shards!r}")
        c = self.index_capacity
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ConfigError("index_capacity", f"must be an int >= 0 (0: grow as needed), got {c!r}")
        r = self.max_restarts
        if isinstance(r, bool) or not isinstance(r, int) or r < -1:
            raise ConfigError("max_restarts", f"must be an int >= -1 (-1: no limit), got {r!r}")
        resources = tuple(self.worker_resources)
        for res in resources:
            if not isinstance(res, Mapping) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                for k, v in res.items()
            ):
                raise ConfigError(
                    "worker_resources", f"each entry must map names to numbers > 0, got {res!r}"
                )
        if n is not None and resources and len(resources) != n:
            raise ConfigError("worker_resources", f"has {len(resources)} entries for {n} workers")
        object.__setattr__(self, "worker_resources", tuple(dict(r) for r in resources))


@dataclass(frozen=True)
class Settings:
    """A validated configuration file: ``cache`` None means ``start()``'s default cache config;
    ``engine_layouts`` (no ``[layout]`` given): each worker takes the page layout of the vLLM
    engines paired with it (``start(engine_layouts=...)``)."""

    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    cache: CacheConfig | None = None
    transfer: TransferConfig = field(default_factory=lambda: TransferConfig(host=NODE_IP))
    routing: RoutingConfig = DEFAULT_ROUTING
    engine_layouts: bool = True


_LAYOUT_DEFAULTS: dict[str, Any] = {
    "num_layers": 8,
    "num_kv_heads": 8,
    "head_dim": 128,
    "tokens_per_block": 16,
    "dtype": "float16",
    "latent_size": 0,
}
"""``latent_size`` 0: keys and values of ``num_kv_heads x head_dim`` per layer; above 0: one
latent of that many values per token and layer instead (an MLA engine's pages,
``raykv.integrations.vllm.layout.mla_layout``; e.g. 576 for DeepSeek V2/V3)."""
_TIER_KEYS = {
    "gpu": {"capacity": "size", "device": int},
    "host": {"capacity": "size", "pin_memory": bool, "shared": bool},
    "disk": {"capacity": "size", "path": str},
}
_CACHE_KEYS = ("max_util_for_resume", "max_events", "verify_disk_checksums", "max_blocks_per_salt")
SECTIONS = ("deployment", "layout", "cache", "tiers", "transfer", "routing")


def parse_size(name: str, value: object) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"2 GiB"``, ``"1.5GB"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ConfigError(name, f"must be bytes (an int) or a size like '512MiB' or '2GiB', got {value!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}


def _check_type(name: str, value: object, hint: Any) -> None:
    """ConfigError unless ``value`` (from TOML) suits the annotation ``hint``."""
    base = hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        base = next(a for a in typing.get_args(hint) if a is not type(None))
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif base is str:
        ok = isinstance(value, str)
    else:
        return
    if not ok:
        raise ConfigError(name, f"must be {expected[base]}, got {value!r}")


def _checked(section: str, table: Mapping[str, Any], cls: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``table``'s keys checked against ``cls``'s fields (names and TOML types)."""
    types = {k: v for k, v in _field_types(cls).items() if k not in skip}
    for key, value in table.items():
        if key not in types:
            raise ConfigError(f"{section}.{key}", f"unknown key; allowed: {', '.join(types)}")
        _check_type(f"{section}.{key}", value, types[key])
    return dict(table)


def _build(section: str, make: Any, **kwargs: Any) -> Any:
    """``make(**kwargs)`` with the config class's error renamed to the dotted key."""
    try:
        return make(**kwargs)
    except (ConfigError, InvalidArgumentError) as exc:
        name = getattr(exc, "field", None) or getattr(exc, "argument", "")
        text = str(exc).split(": ", 1)[-1]
        raise ConfigError(f"{section}.{name}", text) from None


def _layout(layout_t: Mapping[str, Any]) -> KVLayout:
    """``[layout]`` (keys already checked) as keys and values per layer, or as MLA latents when
    ``latent_size`` is above 0 (then without ``num_kv_heads`` and ``head_dim``)."""
    fields = {**_LAYOUT_DEFAULTS, **layout_t}
    latent = fields.pop("latent_size")
    if latent == 0:
        return _build("layout", KVLayout.uniform, **fields)  # type: ignore[no-any-return]
    given = [k for k in ("num_kv_heads", "head_dim") if k in layout_t]
    if latent < 0 or given:
        why = f"an MLA layout has no {' or '.join(given)}" if given else f"must be >= 0, got {latent}"
        raise ConfigError("layout.latent_size", why)
    from raykv.integrations.vllm.layout import mla_layout

    layers, block, dtype = fields["num_layers"], fields["tokens_per_block"], fields["dtype"]
    return _build("layout", mla_layout, num_layers=layers, latent_size=latent, block_size=block, dtype=dtype)  # type: ignore[no-any-return]


def _table(doc: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = doc.get(name, {})
    if not isinstance(value, Mapping):
        raise ConfigError(name, f"must be a table ([{name}]), got {value!r}")
    return dict(value)


def _cache_config(doc: Mapping[str, Any]) -> CacheConfig | None:
    """``[layout]``, ``[cache]`` and ``[tiers.*]`` as a CacheConfig (None when all are absent)."""
    layout_t, cache_t, tiers_t = _table(doc, "layout"), _table(doc, "cache"), _table(doc, "tiers")
    if not (layout_t or cache_t or tiers_t):
        return None
    if not tiers_t:
        raise ConfigError("tiers", "at least one of [tiers.gpu], [tiers.host], [tiers.disk] is required")
    for key, value in layout_t.items():
        if key not in _LAYOUT_DEFAULTS:
            raise ConfigError(f"layout.{key}", f"unknown key; allowed: {', '.join(_LAYOUT_DEFAULTS)}")
        _check_type(f"layout.{key}", value, type(_LAYOUT_DEFAULTS[key]))
    if layout_t.get("dtype", "float16") not in DTYPES:
        raise ConfigError("layout.dtype", f"allowed: {', '.join(DTYPES)}; got {layout_t['dtype']!r}")
    layout = _layout(layout_t)
    tiers = []
    for kind in sorted(tiers_t, key=lambda k: list(_TIER_KEYS).index(k) if k in _TIER_KEYS else -1):
        if kind not in _TIER_KEYS:
            raise ConfigError(f"tiers.{kind}", f"unknown tier; allowed: {', '.join(_TIER_KEYS)}")
        tier = _tier(kind, _table(tiers_t, kind))
        if tier.capacity_bytes < layout.page_bytes:
            raise ConfigError(
                f"tiers.{kind}.capacity",
                f"{tier.capacity_bytes} bytes is less than one page ({layout.page_bytes} bytes)",
            )
        tiers.append(tier)
    cache_kw = _checked("cache", cache_t, CacheConfig, skip=("layout", "tiers"))
    return _build("cache", CacheConfig, layout=layout, tiers=tuple(tiers), **cache_kw)  # type: ignore[no-any-return]


def _tier(kind: str, table: Mapping[str, Any]) -> TierConfig:
    allowed = _TIER_KEYS[kind]
    kw: dict[str, Any] = {}
    for key, value in table.items():
        name = f"tiers.{kind}.{key}"
        if key not in allowed:
            raise ConfigError(name, f"unknown key; allowed: {', '.join(allowed)}")
        if allowed[key] == "size":
            kw["capacity_bytes"] = parse_size(name, value)
        else:
            _check_type(name, value, allowed[key])
            kw[key] = value
    if "capacity_bytes" not in kw:
        raise ConfigError(f"tiers.{kind}.capacity", "is required (bytes, or a size like '8GiB')")
    return _build(f"tiers.{kind}", TierConfig, kind=TierKind.parse(kind), **kw)  # type: ignore[no-any-return]


def _env_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_env(doc: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``doc`` with every ``RAYKV_<SECTION>__<KEY>`` override of ``environ`` applied (a copy)."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in doc.items()}
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or "__" not in var:
            continue
        parts = [p.lower() for p in var[len(ENV_PREFIX) :].split("__")]
        if parts[0] not in SECTIONS or len(parts) != (3 if parts[0] == "tiers" else 2) or not all(parts):
            raise ConfigError(
                var,
                f"not a raykv setting; use RAYKV_<SECTION>__<KEY> with SECTION one of {', '.join(SECTIONS)}",
            )
        table = out.setdefault(parts[0], {})
        if parts[0] == "tiers":
            table = table.setdefault(parts[1], {})
            table[parts[2]] = _env_value(environ[var])
        else:
            table[parts[1]] = _env_value(environ[var])
    return out


def settings_from_dict(doc: Mapping[str, Any]) -> Settings:
    """Validate a parsed TOML document (after overrides) into :class:`Settings`."""
    for key in doc:
        if key not in SECTIONS:
            raise ConfigError(key, f"unknown section; allowed: {', '.join(SECTIONS)}")
    dep_t = _checked("deployment", _table(doc, "deployment"), DeploymentConfig)
    deployment = _build("deployment", DeploymentConfig, **dep_t)
    cache = _cache_config(doc)
    transfer_t = _checked("transfer", _table(doc, "transfer"), TransferConfig)
    transfer = _build("transfer", TransferConfig, **{"host": NODE_IP, **transfer_t})
    routing_t = _checked("routing", _table(doc, "routing"), RoutingConfig, skip=("tokens_per_block",))
    tpb = cache.tokens_per_block if cache is not None else _LAYOUT_DEFAULTS["tokens_per_block"]
    routing = _build("routing", RoutingConfig, tokens_per_block=tpb, **routing_t)
    return Settings(deployment, cache, transfer, routing, engine_layouts=not _table(doc, "layout"))


def load_settings(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """The settings of TOML file ``path`` (None: defaults only) with ``environ``'s overrides.

    Raises ConfigError naming the key for a bad value or key, and for a file that is missing or
    not TOML (``field`` "config").
    """
    doc: dict[str, Any] = {}
    if path is not None:
        try:
            doc = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None
    return settings_from_dict(apply_env(doc, environ if environ is not None else {}))


_HELP = {
    "deployment": {
        "namespace": "Ray namespace of the raykv actors",
        "num_workers": "omit: one CacheWorker per GPU (2 CPU workers on a cluster without GPUs)",
        "index_shards": "IndexShard actors, spread over the nodes",
        "index_capacity": "keys the index is expected to hold, all shards (0: tables grow as needed)",
        "max_restarts": "Ray restarts of a dead worker (-1: without limit)",
        "worker_resources": "e.g. [{node0 = 0.01}, {node1 = 0.01}]: Ray resources worker i needs",
    },
}


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _section_lines(name: str, obj: object, skip: tuple[str, ...] = ()) -> list[str]:
    """``[name]`` with every field of dataclass ``obj`` at its default (None ones commented)."""
    lines = [f"[{name}]"]
    helps = _HELP.get(name, {})
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        if not f.init or f.name.startswith("_") or f.name in skip:
            continue
        value = getattr(obj, f.name)
        note = f"  # {helps[f.name]}" if f.name in helps else ""
        if value is None or value == ():
            lines.append(f"# {f.name} = ...{note}")
        else:
            lines.append(f"{f.name} = {_toml_value(value)}{note}")
    return lines


def defaults_toml() -> str:
    """A commented TOML file holding every default; ``load_settings`` of it gives ``Settings()``."""
    s = Settings()
    out = [
        "# raykv configuration (raykv up --config FILE). Every value below is the default.",
        "# Override any key with RAYKV_<SECTION>__<KEY>, e.g. RAYKV_DEPLOYMENT__NUM_WORKERS=4,",
        "# RAYKV_TIERS__HOST__CAPACITY=8GiB. Sizes take bytes or KiB/MiB/GiB/TiB (KB/MB/GB/TB).",
        "# The meaning of every key: docs/operations.md, section Configuration.",
        "",
        *_section_lines("deployment", s.deployment),
        "",
        "# The cache: omit [layout], [cache] and [tiers.*] for the default (8 layers x 8 KV heads x",
        "# 128 dims, 16 tokens per block, float16; host 512 MiB, disk 2 GiB, and a 4 GiB GPU tier",
        "# with one worker per GPU). Given any of them, [tiers.*] is required. Tiers go warm to cold.",
        "# Without [layout], each worker takes the page layout of the vLLM engines paired with it",
        "# (tier capacities stay in bytes); with it, workers keep it and refuse other engines.",
        "# [layout]   (latent_size > 0, without num_kv_heads and head_dim: an MLA engine's latents)",
        *(f"# {k} = {_toml_value(v)}" for k, v in _LAYOUT_DEFAULTS.items()),
        "# [cache]",
        "# max_util_for_resume = 1.0",
        "# max_events = 100000",
        "# verify_disk_checksums = true",
        "# max_blocks_per_salt = 100000   # omit: no quota per tenant",
        "# [tiers.gpu]",
        '# capacity = "4GiB"',
        "# device = 0",
        "# [tiers.host]",
        '# capacity = "512MiB"',
        "# pin_memory = true",
        "# shared = false   # true: in /dev/shm, readable by same-node peers (needed by vLLM engines)",
        "# [tiers.disk]",
        '# capacity = "2GiB"',
        '# path = "/mnt/nvme/raykv"   # omit: a fresh temporary directory, removed at shutdown',
        "",
        "# Page servers. host: where each worker's page server binds; node-ip: its node's IP",
        "# (127.0.0.1 when every Ray node runs on one machine).",
        *_section_lines("transfer", s.transfer),
        "",
        "# The cost model of raykv's routing (tokens_per_block is the layout's).",
        *_section_lines("routing", s.routing, skip=("tokens_per_block",)),
    ]
    return "\n".join(out) + "\n"

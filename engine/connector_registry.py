"""Connectors by name: `kv_transfer_config.kv_connector` -> its `ConnectorSpec`.

The engine imports no connector package. A package declares its specs as entry points of
the group `pdserve.connectors` (pyproject.toml: `NAME = "package.module:SPEC"`), loaded the
first time a name is asked for — in every process, the spawned EngineCore and TP workers
included, with no import order to get right — or registers one itself with
`register_connector` (an out-of-tree or a test connector).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from importlib.metadata import EntryPoint, distributions

from engine.connector_api import (
    ConnectorConfig,
    ConnectorSpec,
    KVCacheSpec,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVParamsValidator,
)

ENTRY_POINT_GROUP = "pdserve.connectors"

_lock = threading.Lock()
_specs: dict[str, ConnectorSpec] = {}
_loaded = False


def register_connector(spec: ConnectorSpec) -> None:
    """Make `spec` known under `spec.name` (a later registration of the name replaces it)."""
    if not spec.name:
        raise ValueError(f"{type(spec).__name__} has no name")
    with _lock:
        _specs[spec.name] = spec


def _load_entry_points() -> None:
    global _loaded
    with _lock:
        if _loaded:
            return
        for ep in _entry_points():
            spec = ep.load()
            if not isinstance(spec, ConnectorSpec) or spec.name != ep.name:
                raise TypeError(f"entry point {ep.name} = {ep.value} of {ENTRY_POINT_GROUP} is "
                                f"not a ConnectorSpec named {ep.name!r}")
            _specs.setdefault(ep.name, spec)
        _loaded = True


def _entry_points() -> list[EntryPoint]:
    """The group's entry points of every installed distribution. Not
    `importlib.metadata.entry_points`, which reads only the first distribution of a name on
    sys.path: a stale `pdserve.egg-info` in the working directory would hide the installed
    one's (the first found of an entry point's name wins here)."""
    found: dict[str, EntryPoint] = {}
    for dist in distributions():
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP:
                found.setdefault(ep.name, ep)
    return list(found.values())


def connector_names() -> list[str]:
    _load_entry_points()
    return sorted(_specs)


def connector_spec(name: str) -> ConnectorSpec:
    """The spec registered as `name`; ValueError naming the known ones otherwise."""
    _load_entry_points()
    spec = _specs.get(name)
    if spec is None:
        known = ", ".join(sorted(_specs)) or (f"none (no {ENTRY_POINT_GROUP} entry point: "
                                              "is the package installed? pip install -e .)")
        raise ValueError(f"unknown kv_connector {name!r}; known: {known}")
    return spec


def spec_for(config: ConnectorConfig) -> ConnectorSpec | None:
    """The configured connector's spec, None without a kv-transfer config."""
    kv = config.kv_transfer_config
    return None if kv is None else connector_spec(kv.kv_connector)


def transfer_metrics() -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """(counters, summaries) of every registered connector, name -> help: a server exports
    them all, at 0 until its connector reports them."""
    _load_entry_points()
    counters: dict[str, str] = {}
    summaries: dict[str, tuple[str, str]] = {}
    for spec in list(_specs.values()):
        counters.update(spec.counters)
        summaries.update(spec.summaries)
    return counters, summaries


def kv_params_validator(config: ConnectorConfig) -> KVParamsValidator | None:
    """The configured connector's check of a request's kv_transfer_params (a 400 naming the
    field), run in the frontend; None without a connector."""
    spec = spec_for(config)
    return None if spec is None else spec.params_validator(config)


def make_scheduler_half(config: ConnectorConfig, cache: KVCacheSpec
                        ) -> KVConnectorScheduler | None:
    """The scheduler half (the EngineCore's, at every TP size), or None."""
    spec = spec_for(config)
    return None if spec is None else spec.make_scheduler(config, cache)


def make_worker_half(config: ConnectorConfig, cache: KVCacheSpec, tp_rank: int
                     ) -> KVConnectorWorker | None:
    """Rank `tp_rank`'s worker half, built beside that rank's runner (in the EngineCore
    process at TP = 1, in the rank's worker process above), or None."""
    spec = spec_for(config)
    return None if spec is None else spec.make_worker(config, cache, tp_rank)


def prompt_kv_params(spec: ConnectorSpec | None, kv: object, index: int, count: int) -> object:
    """kv_transfer_params of prompt `index` of a list of `count` (unchanged without a spec or
    for a single prompt; params that are not an object are the validator's to refuse)."""
    if spec is None or count == 1 or not isinstance(kv, Mapping):
        return kv
    return spec.prompt_params(dict(kv), index, count)

"""Frozen proxy configuration. Validated once in __post_init__; never mutated after start."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

MODES = ("push", "pull")
P_FAILURE_POLICIES = ("recompute", "cancel")
ROUTING_POLICIES = ("kv-aware", "least-outstanding", "round-robin")  # proxy/routing.py
# kv-aware's --disagg-min-tokens default, measured (`pdserve bench multiturn`,
# bench/results/multiturn*.json): on the 2-core CPU host, short follow-up turns run on D alone
# answered 1.3-1.6x later than disaggregated ones (4 in flight or 1), and the sweep of fresh
# prompts has no stable crossover, so the measured default is 0: always disaggregate
DISAGG_MIN_TOKENS = 0


def normalize_url(url: str) -> str:
    """`http(s)://host:port[/prefix]` without a trailing slash; anything else is a ValueError."""
    text = str(url).strip().rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"backend URL must look like http://host:port, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"backend URL must not carry a query or fragment, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise ValueError(f"backend URL has a bad port: {url!r}") from exc
    return text


@dataclass(frozen=True)
class EventSource:
    """One publisher: the backend it describes, its PUB and (optional) replay address."""

    url: str
    endpoint: str
    replay_endpoint: str | None = None

    @classmethod
    def parse(cls, text: str) -> EventSource:
        """`URL=tcp://host:port[,tcp://host:replay_port]` (the --kv-events flag)."""
        url, sep, rest = text.partition("=")
        addrs = rest.split(",") if sep else []
        if not sep or not 1 <= len(addrs) <= 2 or not all(
                a.startswith(("tcp://", "ipc://")) for a in addrs):
            raise ValueError(f"--kv-events wants URL=tcp://host:port[,tcp://host:port] "
                             f"(publisher, optional replay), got {text!r}")
        return cls(normalize_url(url), addrs[0], addrs[1] if len(addrs) == 2 else None)


@dataclass(frozen=True)
class ProxyConfig:
    """Everything `pdserve proxy` needs. Names match the CLI flags (snake_case).

    `request_timeout` bounds one client request end to end (both legs and the relay);
    `health_interval` is the period of the background health poll of every backend.
    """

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    mode: str = "push"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # guards every route but /health (and /metrics if public)
    public_metrics: bool = False
    p_failure_policy: str = "recompute"
    request_timeout: float = 600.0
    health_interval: float = 2.0
    health_timeout: float = 2.0
    connect_timeout: float = 5.0
    max_body_bytes: int = 8 * 1024 * 1024
    max_connections: int = 1024
    # membership from etcd (proxy/discovery.py) instead of the static lists
    discovery: str | None = None  # etcd[s]://[user[:password]@]host:port
    cluster: str = "default"
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    etcd_watch_idle: float = 10.0  # a watch silent this long is created again
    registration_secret: str | None = None  # verifies signed registrations (the KV secret)
    retries: int = 2  # further pairs a request may try before the client has a byte
    # routing (proxy/routing.py): the policy, its tokenizer, KV event publishers, thresholds
    routing: str = "kv-aware"
    tokenizer: str | None = None
    kv_events: tuple[str, ...] = ()  # URL=tcp://host:port[,tcp://host:replay_port]
    kv_events_topic: str = ""
    disagg_min_tokens: int = 0
    prefill_max_outstanding: int = 0
    decode_max_outstanding: int = 0

    def __post_init__(self) -> None:
        if self.discovery and (self.prefill_urls or self.decode_urls):
            raise ValueError("--discovery replaces --prefill/--decode: give one or the other")
        if int(self.retries) < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries!r}")
        for name in ("prefill_urls", "decode_urls"):
            urls = tuple(normalize_url(u) for u in getattr(self, name))
            if not urls and not self.discovery:
                raise ValueError(f"{name} needs at least one backend URL (or use --discovery)")
            if len(set(urls)) != len(urls):
                raise ValueError(f"{name} lists a backend URL twice: {list(urls)}")
            object.__setattr__(self, name, urls)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.p_failure_policy not in P_FAILURE_POLICIES:
            raise ValueError(
                f"p_failure_policy must be one of {P_FAILURE_POLICIES}, "
                f"got {self.p_failure_policy!r}"
            )
        if not 0 <= int(self.port) <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("request_timeout", "health_interval", "health_timeout", "connect_timeout",
                     "etcd_watch_idle"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_body_bytes", "max_connections"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        _validate_routing(self)
        if self.api_key is not None and not self.api_key:
            object.__setattr__(self, "api_key", None)


def _validate_routing(config: ProxyConfig) -> None:
    """The routing settings (proxy/routing.py)."""
    if config.routing not in ROUTING_POLICIES:
        raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {config.routing!r}")
    for name in ("disagg_min_tokens", "prefill_max_outstanding", "decode_max_outstanding"):
        if int(getattr(config, name)) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(config, name)!r}")
    if config.routing != "kv-aware" and (config.disagg_min_tokens
                                         or config.prefill_max_outstanding):
        raise ValueError("disagg_min_tokens and prefill_max_outstanding need routing kv-aware")
    for text in config.kv_events:
        source = EventSource.parse(text)
        if source.url not in config.prefill_urls + config.decode_urls:
            raise ValueError(f"--kv-events names {source.url}, which is no --prefill or "
                             "--decode backend")

"""Cluster membership over etcd: the engines register themselves, the proxies watch.

`etcd` is the client (etcd's v3 JSON gateway over httpx), `registration` the signed record an
engine writes, `registrar` the engine-side companion that keeps it alive. Sits below the
roles and the proxy, above nothing of ours: it names no role and imports no engine module.
"""

"""The collectors, registered by name.

Each entry is a dotted path imported only when that collector is enabled, so a
collector whose module or library is missing fails alone, when asked for.
"""

from __future__ import annotations

import importlib

from agents.collectors.base import Collector

COLLECTORS: dict[str, str] = {
    "host": "agents.collectors.host:HostCollector",
    "pingmesh": "agents.collectors.pingmesh:PingmeshCollector",
    "xid": "agents.collectors.xid:XidCollector",
    "nccl": "agents.collectors.nccl_log:NcclLogCollector",
    "nic": "agents.collectors.nic:NicCollector",
    "pfc_sniffer": "agents.collectors.pfc_sniffer:PfcSniffer",
    "gpu": "agents.collectors.gpu:GpuCollector",
}


class UnknownCollectorError(KeyError):
    """A collector name that is not in the registry."""


def load_collector_class(name: str) -> type[Collector]:
    """Import and return the collector class registered as ``name``.

    Raises ``UnknownCollectorError`` for a name not registered, and ``ImportError``
    or ``AttributeError`` when its module or class cannot be loaded.
    """
    try:
        target = COLLECTORS[name]
    except KeyError:
        known = ", ".join(sorted(COLLECTORS))
        raise UnknownCollectorError(f"unknown collector {name!r} (known: {known})") from None
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name)
    cls: type[Collector] = getattr(module, class_name)
    return cls

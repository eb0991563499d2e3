"""Which registry vLLM's /metrics serves, and putting a collector on it.

vLLM 0.32 builds /metrics in `attach_router` (vllm/entrypoints/serve/instrumentator/metrics.py) on
`get_prometheus_registry()` (vllm/v1/metrics/prometheus.py). GET /metrics is answered by
prometheus-fastapi-instrumentator's handler, registered there first; vLLM's own Mount after it
only gets /metrics/<more>. In one process that handler serves prometheus_client's global REGISTRY,
where vLLM's metric objects live. With PROMETHEUS_MULTIPROC_DIR set (vLLM sets it for
--api-server-count > 1, which spark-edge refuses; otherwise only a user does) the handler builds a
new registry at every request whose only collector reads the multiprocess files: no collector
registered in a process can appear there.
"""

from __future__ import annotations

import logging

from prometheus_client.registry import REGISTRY, Collector

_LOG = logging.getLogger("vllm.spark_edge.metrics")


def vllm_serves_registry() -> bool:
    """True when vLLM's /metrics serves REGISTRY, i.e. not in prometheus_client's multiprocess mode."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    return get_prometheus_registry() is REGISTRY


def register_where_vllm_serves(collector: Collector) -> bool:
    """Register on REGISTRY; False (and a warning) when vLLM's /metrics will not show it."""
    REGISTRY.register(collector)
    if vllm_serves_registry():
        return True
    _LOG.warning(
        "spark-edge: PROMETHEUS_MULTIPROC_DIR is set, so vLLM's /metrics serves only the multiprocess "
        "files: spark-edge's series (memory, compile cache, build info) and process_start_time_seconds "
        "will be missing from it, and the alerts on them silent. Unset it: spark-edge runs one API server."
    )
    return False

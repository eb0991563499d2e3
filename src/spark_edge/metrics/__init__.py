"""Measurements the operator sees: process-tree memory and CPU, and the Prometheus series on vLLM's /metrics."""

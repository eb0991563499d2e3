"""Measurements the operator sees: process-tree memory, and (later) Prometheus series."""

"""Telemetry shared by the router and the replicas: traces, metrics, log lines."""

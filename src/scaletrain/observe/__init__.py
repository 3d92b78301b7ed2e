"""Observability: the job's live figures (catalog.py), each process's share of them
(telemetry.py), and the launcher's Prometheus endpoint over them (exporter.py)."""

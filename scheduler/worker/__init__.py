"""The worker process: claims, dispatches, heartbeats, finishes and recovers (`manage.py
scheduler_worker`), and its own /metrics and health endpoint."""

"""The Batch API on the durable queue: stored files, batches and their lines (models.py), their
writes (services.py), the feeder that moves lines into the queue and finalizes batches (feeder.py),
and the files they answer with (output.py). The HTTP side is scheduler/gateway/batches/."""

"""The queue core's rules and reads: queue policies and their bounds, the claim's view of the
cluster, the one lock order, the configuration cache and what each job type asks of an executor."""

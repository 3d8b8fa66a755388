def __getattr__(name: str):
    """`from scheduler import governed_slot`: the public face of a slot for app code, imported on
    first use (the app registry must be ready before models are)."""
    if name == "governed_slot":
        from scheduler.flows.governed import governed_slot

        return governed_slot
    raise AttributeError(f"module 'scheduler' has no attribute {name!r}")

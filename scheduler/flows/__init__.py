"""Agent flows and app-driven rounds: a flow's round as the worker runs it, and `governed_slot`
for app code that runs its own agent loop."""

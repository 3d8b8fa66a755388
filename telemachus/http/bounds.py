"""Upper bounds on the numbers the API stores, shared by every entry point that takes them (the
REST serializers, the OpenAI-compatible gateway, the dashboard's actions), so a number is refused
with a 400 naming its field instead of overflowing a column or an estimate (a 500) or asking a
model server for the impossible."""

# Completion tokens one model call may ask for (`max_tokens`, `max_completion_tokens`).
MAX_TOKENS = 10_000_000
# A submitter's token estimate for one job (or one round of a flow).
EST_TOKENS_MAX = 10**12
# Memory a job may require or an executor offer, in MB (2 PiB: far past any machine).
MEMORY_MB_MAX = 2**31 - 1
# Length of the vectors an embeddings call may ask for.
DIMENSIONS_MAX = 65_536
# Row ids are bigints: anything larger names no row.
ID_MAX = 2**63 - 1

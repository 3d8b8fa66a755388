"""The live dashboard: its WebSocket consumer, the actions an operator takes from it, and the
queue snapshot it shows (also served as GET /api/queue/)."""

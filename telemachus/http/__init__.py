"""HTTP plumbing shared by every app's API: parsing, errors, pagination, throttles, the
schema's error declarations, body limits, health and the WebSocket origin check."""

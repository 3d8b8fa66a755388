"""Credentials: apps' API keys and people's API tokens, stored as digests (see digests.py), and
how requests authenticate with them (authentication.py). docs/keys.md tells the story."""

"""The engine's core (requests, block pool, KV-cache manager, scheduler): no torch."""

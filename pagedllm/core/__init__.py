"""The engine's core: requests, block pool, KV-cache manager, scheduler.

Imports only the standard library (and numpy at most): no torch, so these modules'
tests run in milliseconds and need no model.
"""

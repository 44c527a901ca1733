"""Backends behind the Pool/Device interfaces, found through the registry."""

"""Drafters propose tokens for the target to verify: n-gram lookup, draft models, Medusa heads, EAGLE."""

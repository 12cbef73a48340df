"""Speculative decoding over an engine: the generation loop, its rounds, the controller and gain rule, verification."""

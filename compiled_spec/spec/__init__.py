"""Speculative decoding: on-device rejection sampling and acceptance metrics."""

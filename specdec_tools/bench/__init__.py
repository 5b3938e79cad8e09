"""Spec-Bench-style measurement of decoding methods."""

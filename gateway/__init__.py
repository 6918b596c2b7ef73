"""trajgate gateway: the OpenAI-compatible capture proxy, its store and the CLI.

This package must never import the trainer (no torch here), so the gateway starts fast.
"""

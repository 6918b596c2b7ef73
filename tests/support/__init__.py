"""Helpers the tests share, and the benches and scripts that run the gateway as the tests do: fakes, harnesses, seeds."""

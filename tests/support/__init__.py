"""Helpers the tests share, and that the benches and scripts use to run the gateway as the tests do: fakes of vLLM and
the judge, the in-process gateway, a throwaway Postgres, seeded data and waits."""

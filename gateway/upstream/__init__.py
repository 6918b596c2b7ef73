"""vLLM as the gateway sees it: the HTTP client and the replicas behind it."""

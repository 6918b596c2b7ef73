"""HTTP plumbing every surface shares (errors, auth, limits, metrics) and the request dependencies."""

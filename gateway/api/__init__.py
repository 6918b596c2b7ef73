"""The gateway's ordinary endpoints (health, rewards, runs, reads, judge): thin handlers over the store."""

"""An LLM judge for groups of trajectories: one prompt per group, one score in [0, 1] per trajectory, stored as the
trajectories' rewards through the same code path agents' rewards take (`store_rewards`).

Nothing here imports litellm at module level: the gateway imports this package at start-up (for its route) and
must stay fast; litellm is imported on the first judge call, off the event loop (see `providers`).
"""

"""The trainer process: the loop that follows a run, publishing adapters, experiment trackers."""

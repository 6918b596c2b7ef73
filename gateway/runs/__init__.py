"""What a run and a process are configured with: run config, run names, the TRAJGATE_* settings."""

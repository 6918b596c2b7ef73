"""trajgate trainer."""

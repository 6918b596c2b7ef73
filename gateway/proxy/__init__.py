"""One model call: receive -> attribute -> admit -> forward -> relay -> record (and token-in)."""

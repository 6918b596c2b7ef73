"""The web UI: server-rendered pages, the tree view, tokens' text; templates/ and static/ beside them."""

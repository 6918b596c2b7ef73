"""Records on their way to the database: the WAL/spool, the writer thread and process, peers."""

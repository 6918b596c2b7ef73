"""Alembic migrations: the single source of the schema for Postgres and SQLite."""

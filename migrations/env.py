"""Alembic environment: runs migrations online against the URL the caller configured."""

from __future__ import annotations

from alembic import context

from gateway.store.db import make_engine
from gateway.store.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    engine = make_engine(config.get_main_option("sqlalchemy.url"))
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                # SQLite can't ALTER most things in place; batch mode rebuilds tables instead.
                render_as_batch=connection.dialect.name == "sqlite",
                compare_type=True,
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run `trajgate migrate` against a database")
run_migrations_online()

"""`trajgate`: the one command-line entry point, with a subcommand per process or chore."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from gateway.config import ConfigError, Settings, load_settings

DESCRIPTION = """\
trajgate records every call your agent makes through an OpenAI-compatible gateway (exact token ids and
logprobs) and trains a LoRA adapter on rewarded groups of those calls with GRPO.

Configuration comes from TRAJGATE_* environment variables (or a .env file), e.g.
  TRAJGATE_DATABASE_URL   sqlite:///trajgate.db (default) or postgresql://user@host/db
  TRAJGATE_UPSTREAM_URL   vLLM's OpenAI base URL, e.g. http://127.0.0.1:8001/v1
  TRAJGATE_BASE_MODEL     the name vLLM serves the base model under
"""


def _migrate(settings: Settings, args: argparse.Namespace) -> int:
    from gateway.store import db

    started = time.perf_counter()
    before = db.current_revision(settings.database_url)
    db.upgrade(settings.database_url, args.revision)
    after = db.current_revision(settings.database_url)
    where = settings.database_url.split("@")[-1]
    change = "already at" if before == after else f"{before or 'empty'} ->"
    print(f"migrate: {where}: {change} {after} ({time.perf_counter() - started:.2f}s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trajgate", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    migrate = sub.add_parser(
        "migrate",
        help="create or upgrade the database schema (safe to run repeatedly)",
        description="Upgrade TRAJGATE_DATABASE_URL to the newest schema. Idempotent: at head it does nothing.",
    )
    migrate.add_argument("--revision", default="head", help="target Alembic revision (default: head)")
    migrate.set_defaults(handler=_migrate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[Settings, argparse.Namespace], int] = args.handler
    try:
        settings = load_settings()
    except ConfigError as exc:
        print(f"trajgate: {exc}", file=sys.stderr)
        return 2
    return handler(settings, args)


if __name__ == "__main__":
    sys.exit(main())

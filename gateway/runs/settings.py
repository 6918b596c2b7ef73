"""All configuration in one place, read from `TRAJGATE_*` environment variables (and an optional `.env`).

One object so every process (gateway, trainer, CLI) agrees on what a setting means and a typo fails at start,
naming the variable, instead of surfacing as odd behaviour later.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gateway.runs.names import run_name_problem

ENV_PREFIX = "TRAJGATE_"


class ConfigError(Exception):
    """A setting is invalid; the message is one line that names the environment variable."""


class AgentKey(SecretStr):
    """An agent key and the runs it is bound to (None: any run, as every key before tenants). A SecretStr, so it
    prints masked and everything that reads keys as secrets (gateway/judge/policy.py) reads these unchanged."""

    def __init__(self, secret_value: str, runs: frozenset[str] | None = None) -> None:
        super().__init__(secret_value)
        self.runs = runs


def parse_agent_keys(value: str) -> list[AgentKey]:
    """`TRAJGATE_AGENT_KEYS`: entries separated by ';', each either `KEY=RUN[,RUN...]` (a key bound to those runs)
    or today's comma-separated unbound keys.

    An entry is a binding only when the text after its LAST '=' is a comma-separated list of valid run names (run
    names never hold '='), so a base64 key's padding (`abc==`, `abc=,def`) still reads as unbound keys. What could be
    a mistyped binding is refused rather than read as unbound keys, which would open every run to the key: an
    unbound key may hold '=' only as trailing padding, and a bound entry holds exactly one key (several bound keys
    are several ';'-separated entries). Messages name an entry by its position, never its text: it holds a key.
    """
    keys: list[AgentKey] = []
    bound: dict[str, frozenset[str] | None] = {}
    entries = [entry.strip() for entry in value.split(";") if entry.strip()]
    for number, entry in enumerate(entries, 1):
        where = f"entry {number} (entries are separated by ';')"
        key, equals, tail = entry.rpartition("=")
        runs = [run.strip() for run in tail.split(",")]
        if equals and all(run_name_problem(run) is None for run in runs):
            key = key.strip()
            if not key or "," in key:
                raise ValueError(f"{where}: a binding is one key, '=', then run names: KEY=RUN[,RUN...]")
            parsed = [AgentKey(key, frozenset(runs))]
        else:
            parsed = [AgentKey(key) for key in (key.strip() for key in entry.split(",")) if key]
            if any("=" in key.get_secret_value().rstrip("=") for key in parsed):
                raise ValueError(
                    f"{where}: after its last '=' comes neither nothing nor a list of run names "
                    "(KEY=RUN[,RUN...]; a run name: 1-128 of [A-Za-z0-9._:/-]; no empty item)"
                )
        for agent_key in parsed:
            secret = agent_key.get_secret_value()
            if secret in bound and bound[secret] != agent_key.runs:
                raise ValueError(f"{where}: a key given earlier appears again with other runs")
            bound[secret] = agent_key.runs
            keys.append(agent_key)
    return keys


class Settings(BaseSettings):
    # (hide_input_in_errors: TRAJGATE_AGENT_KEYS is parsed from its raw text, which a validation error would quote)
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_file=".env", extra="ignore", hide_input_in_errors=True)

    database_url: str = Field(
        "sqlite:///trajgate.db",
        description="SQLAlchemy URL; SQLite file in the working directory by default, postgresql://... for Postgres.",
    )
    upstream_url: str = Field(
        "http://127.0.0.1:8001/v1",
        description="vLLM's OpenAI base URL (ends in /v1); several replicas: their URLs, comma-separated.",
    )
    replica_probe_s: float = Field(
        2.0, gt=0, description="Several replicas: how often each one's /models is asked (health, adapters served)."
    )
    base_model: str | None = Field(None, description="Name vLLM serves the base model under.")
    base_weights: str | None = Field(
        None, description="Weights the trainer loads for runs that name none: the same weights vLLM serves."
    )
    agent_keys: Annotated[list[AgentKey], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated keys agents may use; empty means no agent auth. A key bound to runs is an entry "
        "`KEY=RUN[,RUN...]`, entries separated by ';' (docs/design.md §13, Tenants).",
    )
    admin_key: SecretStr | None = Field(None, description="Key for admin and read endpoints; unset means no auth.")
    judge_key_envs: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Environment variables a judge config may name in `api_key_env` (comma-separated), besides any "
        "named TRAJGATE_JUDGE_KEY_*; never the database URL or the admin and agent keys (gateway/judge/policy.py).",
    )
    judge_api_bases: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Base URLs a judge config may name in `api_base` (comma-separated), besides the vLLM upstreams.",
    )
    spool_dir: Path = Field(
        Path("spool"), description="The write-ahead log: every record is appended here before its answer completes."
    )
    wal_fsync_ms: float = Field(
        10.0,
        ge=0,
        description="Group fsync interval of the spool: the most answered calls a power loss can take (0: every call).",
    )
    checkpoint_dir: Path = Field(Path("checkpoints"), description="Adapters and optimizer state, per run and step.")
    tracker_project: str = Field("trajgate", description="`trajgate train --log-to`: the tracker project / experiment.")
    tracker_name: str | None = Field(None, description="`trajgate train --log-to`: the tracker run name (default: the run).")

    host: str = Field("127.0.0.1", description="Address `trajgate serve` listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port `trajgate serve` listens on.")
    upstream_api_key: SecretStr | None = Field(None, description="Key vLLM expects (its --api-key), if any.")
    teacher_api_key: SecretStr | None = Field(
        None,
        description="Key the distillation teacher's endpoint expects (a run's teacher_base_url), if any; default: "
        "the upstream key when the teacher is served by the run's own vLLM, none otherwise.",
    )
    upstream_timeout_s: float = Field(600.0, gt=0, description="Longest wait for vLLM between bytes of a response.")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 above).")
    writer_queue_size: int = Field(10_000, ge=1, description="Records held in memory before spilling to the spool.")
    writer_batch_size: int = Field(256, ge=1, description="Records per database transaction.")
    writer_queue_bytes: int = Field(
        128 * 1024 * 1024,
        ge=1,
        description="Bytes of spool lines held in memory before spilling (the first 512 queued records, and with a "
        "writer process all, are held as records too, about 5x their lines).",
    )
    writer_process: bool = Field(
        False,
        description="On Postgres, write batches from a process of its own (gateway.recorder.writer_process): for a machine with "
        "a core to spare, where the database work then takes neither the event loop's GIL nor its core. On one shared "
        "core it delays calls or lags (bench/README.md). SQLite always writes on the writer thread.",
    )
    writer_nice: int = Field(
        19,
        ge=0,
        le=19,
        description="How much lower the writer's OS priority is than the event loop's (its thread's, on Linux, and its "
        "process's with writer_process): the event loop, woken by a call, then takes the core from a writer writing a "
        "batch (on a 2-core AMD EPYC, 19 took the added p99 at c=1 from +2.3 to +0.9 ms, bench/README.md). "
        "While records pile up or a reward waits for them, a relief "
        "thread at the process's priority writes instead (not with writer_process). 0: one writer thread, no relief; "
        "the setting for a machine whose cores other processes keep busy (vLLM CPU beside the gateway), where a lowered "
        "writer preempted holding the GIL stalls the event loop (bench/README.md, writer_starved.py).",
    )
    writer_idle: bool = Field(
        True,
        description="With writer_nice above 0, the writer thread also runs under Linux's SCHED_IDLE policy, so the "
        "event loop, woken by a call, takes the core from it at once (a nice-19 thread may finish its slice first: on "
        "a 6.18 kernel this took the added p99 at c=1 from +1.3 to +0.8 ms, bench/README.md). Not the relief, nor with "
        "writer_process (the thread that feeds it has no relief).",
    )
    writer_slice_us: int = Field(
        50,
        ge=0,
        description="How long the writer thread runs before pausing for the event loop, in µs (0: it never pauses). "
        "It shares the event loop's core: a shorter slice delays calls less while a batch is written, and records "
        "reach the database a little later. It pauses only while few calls are in flight, not once the gateway has "
        "been quiet for 0.1 s, and for less the more records wait behind the batch (gateway/store/courtesy.py).",
    )
    writer_pause_us: int = Field(
        200,
        ge=1,
        le=100_000,
        description="How long each of those pauses is, in µs, with nothing queued behind the batch; with a batch's "
        "worth queued, a moment.",
    )
    max_header_bytes: int = Field(65_536, ge=1024, description="Largest request head (431 above).")
    request_read_timeout_s: float = Field(
        60.0, gt=0, description="Longest time from a request's first byte to the end of its body (408, or closed)."
    )
    keep_alive_s: float = Field(
        75.0, gt=0, description="How long an idle connection is kept open (before its first request or between)."
    )
    token_state_wait_s: float = Field(
        2.0,
        ge=0,
        le=60,
        description="token_in runs: how long a call whose history holds an assistant message no record matches yet "
        "waits for another gateway's record of it to be written before it starts a new token segment.",
    )
    token_in_templates: str | None = Field(
        None,
        description="token_in runs: a JSON file of chat templates the operator vouches for, beside the qualified "
        "ones (gateway/proxy/qualified_templates.json, same shape: fingerprint -> name, end_token_ids, turn_end_ids). "
        "A template in neither is refused (template_not_qualified).",
    )
    vllm_max_loras: int | None = Field(
        None,
        ge=1,
        description="vLLM's adapter slots: the same number as its --max-loras. The trainer refuses to start runs "
        "needing more (keep-adapters + 1 each) and queues a publication while all are taken; the gateway reports "
        "them on /metrics. Unset: not checked (vLLM drops its least recently used adapter past its slots).",
    )
    peer_poll_s: float = Field(
        0.1,
        gt=0,
        le=1,
        description="Several gateways on one Postgres: how often each tells the others how far its record writer got "
        "(and how often a reward waiting for another gateway's calls looks again).",
    )
    peer_alive_s: float = Field(
        10.0,
        ge=1,
        le=600,
        description="A gateway silent this long (killed, or cut off from the database) is no longer waited for.",
    )
    peer_wait_s: float = Field(
        30.0,
        ge=0,
        le=600,
        description="Longest a reward, close or judge request waits for other gateways to write the calls they "
        "answered before it arrived (then a 503, nothing stored); 0 does not wait for them.",
    )
    writer_wait_s: float = Field(
        30.0,
        gt=0,
        le=600,
        description="Longest a reward, close or judge request waits for this gateway's own writer to store the "
        "calls it answered before the request arrived (then a 503 calls_not_written with Retry-After, nothing "
        "stored: a group is never made ready without a call its agent was already answered).",
    )
    db_threads: int = Field(
        32,
        ge=1,
        le=512,
        description="Threads for the database work of the ordinary endpoints (reads, rewards, runs): each holds a "
        "thread while SQLite's busy timeout or Postgres makes it wait, so a reward burst must not starve the reads.",
    )
    responses_memory_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="OpenAI Responses API: how much of the recent stored responses (their conversation and answer, "
        "as JSON) is kept in memory for `previous_response_id` and `GET /v1/responses/{id}`, oldest dropped first; "
        "the others are read back from the database (0: keep none).",
    )
    admission_poll_s: float = Field(
        0.5,
        gt=0,
        le=60,
        description="How often calls waiting for admission ask the database again for room (the trainer frees it "
        "by training, dropping or publishing, which the gateway is not told of).",
    )
    ui_session_s: float = Field(
        12 * 3600.0,
        gt=0,
        le=90 * 86400,
        description="How long a web UI login lasts; logging out, or changing the admin key, ends it sooner.",
    )
    forwarded_allow_ips: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["127.0.0.1"],
        description="Reverse proxies (IP addresses, comma-separated; * for any) whose X-Forwarded-Proto: https makes "
        "the web UI's session cookie Secure, as uvicorn's --forwarded-allow-ips; a request that reached the gateway "
        "over https directly always gets it.",
    )
    ui_token_text_timeout_s: float = Field(
        5.0,
        gt=0,
        le=120,
        description="Trajectory page: longest wait for vLLM's derender to give the completion tokens' text (the "
        "page shows token ids instead past it).",
    )
    max_connections: int | None = Field(
        None, ge=1, description="Open connections before new ones get a 503; unset: half the open-file limit."
    )

    @field_validator("database_url")
    @classmethod
    def _normalise_database_url(cls, url: str) -> str:
        """Accept the URLs people paste (postgres://, postgresql://) and pin the psycopg 3 driver."""
        url = url.strip()
        for prefix in ("postgres://", "postgresql://"):
            if url.startswith(prefix):
                return "postgresql+psycopg://" + url[len(prefix) :]
        if url.startswith(("postgresql+psycopg://", "sqlite://")):
            return url
        raise ValueError("must start with sqlite:/// or postgresql://")

    @field_validator("upstream_url")
    @classmethod
    def _check_upstream_url(cls, value: str) -> str:
        urls = [url.strip().rstrip("/") for url in value.split(",") if url.strip()]
        if not urls or not all(url.startswith(("http://", "https://")) for url in urls):
            raise ValueError("must be an http(s) URL such as http://vllm:8000/v1 (several: comma-separated)")
        if len(set(urls)) != len(urls):
            raise ValueError("lists the same replica twice")
        return ",".join(urls)

    @field_validator("agent_keys", mode="before")
    @classmethod
    def _parse_agent_keys(cls, value: object) -> object:
        return parse_agent_keys(value) if isinstance(value, str) else value

    @field_validator("judge_key_envs", "forwarded_allow_ips", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value

    @field_validator("judge_api_bases", mode="before")
    @classmethod
    def _split_api_bases(cls, value: object) -> object:
        if isinstance(value, str):
            value = [url.strip() for url in value.split(",") if url.strip()]
        if isinstance(value, list):
            if not all(isinstance(url, str) and url.startswith(("http://", "https://")) for url in value):
                raise ValueError("must be http(s) URLs such as http://judge:8000/v1 (several: comma-separated)")
            return [url.rstrip("/") for url in value]
        return value

    @field_validator("agent_keys")
    @classmethod
    def _check_keys(cls, keys: list[AgentKey]) -> list[AgentKey]:
        # '#' separates a real key from attribution in the api-key form, so a key may not contain it.
        if any("#" in key.get_secret_value() for key in keys):
            raise ValueError("a key may not contain '#'")
        return keys

    @field_validator(
        "admin_key", "base_model", "base_weights", "upstream_api_key", "teacher_api_key", "tracker_name", mode="before"
    )
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @model_validator(mode="after")
    def _bindings_need_an_admin_key(self) -> Settings:
        # With no admin key the reads, the export and the UI are open to anyone: binding keys to runs would wall
        # nothing off, and saying so at start beats a deployment that believes its tenants are apart.
        if self.admin_key is None and any(key.runs is not None for key in self.agent_keys):
            raise ValueError(
                f"{ENV_PREFIX}AGENT_KEYS binds keys to runs, which walls nothing off while TRAJGATE_ADMIN_KEY is unset (the "
                "read, export and admin endpoints are open to anyone): set TRAJGATE_ADMIN_KEY"
            )
        return self

    @property
    def upstream_urls(self) -> list[str]:
        """The vLLM replicas, in the order given (one for a single upstream)."""
        return self.upstream_url.split(",")

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")


def load_settings(**overrides: Any) -> Settings:
    """Build settings, turning pydantic's multi-line report into one line naming the variable."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        if not first["loc"]:  # a rule across settings: its message names them
            raise ConfigError(first["msg"].removeprefix("Value error, ")) from None
        field = str(first["loc"][0])
        raise ConfigError(f"invalid {ENV_PREFIX}{field.upper()}: {first['msg']}") from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings, read once."""
    return load_settings()

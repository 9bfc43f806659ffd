"""llama.cpp as the served benchmark's peer: its own server and batched bench, built from source, and GGUFs of
a Hugging Face folder (bench.scenarios.served_peers).

The source is the llama.cpp that the llama-cpp-python sdist vendors (one `pip download` from PyPI, so the
build needs no other network), compiled with `-DGGML_NATIVE=ON` (the machine's own instruction set, as a
user who builds llama.cpp gets) and OpenMP, with Ninja where it is installed: 10-25 minutes on 2 cores,
once; the binaries are kept in the work folder. The GGUFs are converted with llama.cpp's own
`convert_hf_to_gguf.py` (f32) and `llama-quantize` (q8_0, q4_0).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from bench.proc import run_logged

SDIST = "llama-cpp-python==0.3.36"
TARGETS = ("llama-server", "llama-batched-bench", "llama-quantize")
QUANTS = ("q8_0", "q4_0")  # llama-quantize's names; f32 is the converter's output
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_OPENMP=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    # ggml's AMX kernels crash (SIGSEGV in ggml_backend_amx_mul_mat) on q8_0/q4_0 on the AMX VMs this was
    # measured on; GCC's explicit -mno- flags win over -march=native's, so AVX-512 VNNI stays
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
)


def source(work: Path) -> Path:
    """work/llama.cpp: the vendored source, unpacked from the sdist on first use."""
    src = work / "llama.cpp"
    if src.is_dir():
        return src
    sdist = work / "sdist"
    run_logged(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            SDIST,
            "-d",
            str(sdist),
        ]
    )
    (archive,) = sdist.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(sdist, filter="data")
    (vendored,) = sdist.glob("llama_cpp_python-*/vendor/llama.cpp")
    vendored.rename(src)
    return src


def binaries(work: Path) -> Path:
    """The folder of the built binaries (TARGETS), compiled on first use."""
    src = source(work)
    bin_dir = src / "build" / "bin"
    if all((bin_dir / target).is_file() for target in TARGETS):
        return bin_dir
    build = src / "build"
    if shutil.which("cmake") is None:
        raise SystemExit(
            "building llama.cpp needs cmake and a C++ compiler: apt-get install cmake g++ ninja-build"
        )
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []  # else cmake's default, make
    run_logged(["cmake", "-S", str(src), "-B", str(build), *generator, *CMAKE_FLAGS])
    run_logged(["cmake", "--build", str(build), f"-j{os.cpu_count() or 1}", "--target", *TARGETS])
    return bin_dir


# llama.cpp's convert_hf_to_gguf.py, run so that a family whose converter reads only byte-level BPE
# tokenizers (Qwen3-MoE's, with a known pre-tokenizer) takes a SentencePiece tokenizer.model as the
# Llama converter does: the bench models (C-moe) carry C-llama's SentencePiece tokenizer, and the served
# benchmarks send token ids, so the vocabulary's kind changes nothing measured. Weights are converted by
# llama.cpp's own code either way. argv: the llama.cpp source folder, then the converter's arguments.
CONVERT = """
import sys
from pathlib import Path
src = sys.argv.pop(1)
sys.path.insert(0, src)
from conversion.base import TextModel
bpe = TextModel._set_vocab_gpt2
def vocab(self):
    if (Path(self.dir_model) / "tokenizer.model").is_file():
        self._set_vocab_sentencepiece()
    else:
        bpe(self)
TextModel._set_vocab_gpt2 = vocab
sys.argv[0] = src + "/convert_hf_to_gguf.py"
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gguf_path(work: Path, model_dir: Path, quant: str) -> Path:
    return work / "gguf" / f"{model_dir.name}-{quant}.gguf"


def ggufs(work: Path, model_dir: Path) -> dict[str, Path]:
    """The model as GGUF f32, q8_0 and q4_0 (converted on first use), by llama.cpp's name of each."""
    src, bin_dir = source(work), binaries(work)
    f32 = gguf_path(work, model_dir, "f32")
    if not f32.is_file():
        f32.parent.mkdir(parents=True, exist_ok=True)
        convert = [sys.executable, "-c", CONVERT, str(src), str(model_dir), "--outtype", "f32"]
        run_logged([*convert, "--outfile", str(f32)], env={"PYTHONPATH": str(src / "gguf-py")})
    out = {"f32": f32}
    for quant in QUANTS:
        out[quant] = gguf_path(work, model_dir, quant)
        if not out[quant].is_file():
            quantize = [str(bin_dir / "llama-quantize"), str(f32), str(out[quant]), quant]
            run_logged([*quantize, str(os.cpu_count() or 1)])
    return out


@dataclass(frozen=True)
class BatchedRow:
    """One row of llama-batched-bench's table: `batch` sequences, each a `prompt`-token prefill then `new`
    decode steps; times in seconds."""

    prompt: int
    new: int
    batch: int
    prefill_s: float
    decode_s: float
    total_s: float

    @property
    def tok_s(self) -> float:
        """New tokens per second of the whole run, prefill included (as the engine bench counts)."""
        return self.new * self.batch / self.total_s


_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*\d+\s*\|" + r"\s*([\d.]+)\s*\|" * 6)


def parse_batched_bench(text: str) -> list[BatchedRow]:
    """The rows of llama-batched-bench's markdown table:
    | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |"""
    rows = []
    for line in text.splitlines():
        match = _ROW.match(line.strip())
        if match:
            pp, tg, b = (int(match.group(i)) for i in (1, 2, 3))
            t_pp, t_tg, t = (float(match.group(i)) for i in (4, 6, 8))
            rows.append(BatchedRow(pp, tg, b, t_pp, t_tg, t))
    return rows


def batched_bench(
    bin_dir: Path, gguf: Path, prompt: int, new: int, batches: list[int], threads: int
) -> list[BatchedRow]:
    """`llama-batched-bench -npp prompt -ntg new -npl batches` (separate prompts per sequence)."""
    command = [
        str(bin_dir / "llama-batched-bench"),
        *("-m", str(gguf), "-c", str(max(batches) * (prompt + new) + 64)),
        *("-npp", str(prompt), "-ntg", str(new), "-npl", ",".join(map(str, batches))),
        *("-t", str(threads), "-tb", str(threads)),
    ]
    print(f"$ {shlex.join(command)}", flush=True)
    out = subprocess.run(command, check=True, capture_output=True, text=True)
    return parse_batched_bench(out.stdout)

"""Hugging Face models through the whole path: a folder -> `textgen-export hf` -> a running server -> tokens.

For every family (tests/support/hf_models.py: a tiny random model with perturbed norms and biases, saved with
save_pretrained beside a BPE tokenizer with the family's special tokens and chat template; Llama's checkpoint
sharded and in bfloat16), the bundle `textgen-export hf` writes is served, and:
- the greedy tokens of several text prompts sent together (so the server batches them) equal transformers'
  `generate` of each prompt alone;
- text prompts tokenize as the Hugging Face tokenizer does (Llama's BOS included);
- every EOS id of generation_config.json ends a generation, and min_new_tokens bans them all;
- GetModelInfo and the manifest carry the EOS ids, BOS and chat template.
Then every bad input exits 1 with one line naming the file, and a hub id resolves through the local cache.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from hf_models import FAMILIES, SEED, STEPS, Family, build, hf_greedy, rewrite_config
from running_server import RunningServer, loopback_settings
from safetensors.torch import load_file, save_file
from server_tools import LoopThread
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from export.cli import main
from export.hf_import import locate_model
from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.bundle import load_bundle

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ("the of and 12", "is for on that with which as by", " 7 be", "from this to it not 2001")
CASES: dict[str, tuple[Family, dict[str, Any]]] = {
    "llama-sharded-bf16": (FAMILIES["llama"], {"dtype": torch.bfloat16, "max_shard_size": "40KB"}),
    "mistral": (FAMILIES["mistral"], {}),
    "qwen2": (FAMILIES["qwen2"], {}),
    "qwen3": (FAMILIES["qwen3"], {}),
    "gpt2": (FAMILIES["gpt2"], {}),
    "qwen3-moe": (FAMILIES["qwen3-moe"], {}),
}


@dataclass
class Exported:
    family: Family
    model: PreTrainedModel  # fp32, exactly the saved weights
    tokenizer: PreTrainedTokenizerBase
    folder: Path
    bundle: Path
    eos_ids: list[int]  # generation_config.json's


def _second_eos(model: PreTrainedModel, prompt: list[int], first_eos: int) -> tuple[int, int]:
    """A token the model emits greedily after the prompt, at step k >= 3 and not before: (token, k)."""
    tokens = hf_greedy(model, prompt).tokens[0].tolist()
    for k, token in enumerate(tokens):
        if k >= 3 and token not in tokens[:k] and token != first_eos:
            return token, k
    raise AssertionError(f"no fresh greedy token in {tokens}")


def _export_with_cli(folder: Path, bundle: Path) -> None:
    """`python -m export hf`, as an operator runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "export", "hf", "--model", str(folder), "--out", str(bundle)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PASSED" in done.stdout and "verification against transformers" in done.stdout


def _export(name: str, root: Path) -> Exported:
    family, build_args = CASES[name]
    folder, bundle = root / "model", root / "bundle"
    model = build(family.make_config(), folder, **build_args)
    family.save_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    eos = family.id(family.eos)
    assert eos is not None
    # A second EOS, as Llama 3 and Qwen2.5 list several: one the model really emits.
    second, _ = _second_eos(model, tokenizer(TEXTS[0]).input_ids, eos)
    eos_ids = [eos, second]
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = eos_ids
    (folder / "generation_config.json").write_text(json.dumps(generation))
    if family.name == "llama":
        _export_with_cli(folder, bundle)
    else:
        assert main(["hf", "--model", str(folder), "--out", str(bundle)]) == 0
    return Exported(family, model, tokenizer, folder, bundle, eos_ids)


@pytest.fixture(scope="module")
def exports() -> dict[str, Exported]:
    """Each case's export, made once per module whichever fixture asks for it first."""
    return {}


def _exported(name: str, exports: dict[str, Exported], tmp_path_factory: pytest.TempPathFactory) -> Exported:
    if name not in exports:
        exports[name] = _export(name, tmp_path_factory.mktemp(name))
    return exports[name]


@pytest.fixture(scope="module", params=list(CASES))
def exported(
    request: pytest.FixtureRequest, exports: dict[str, Exported], tmp_path_factory: pytest.TempPathFactory
) -> Exported:
    return _exported(request.param, exports, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen2(exports: dict[str, Exported], tmp_path_factory: pytest.TempPathFactory) -> Exported:
    return _exported("qwen2", exports, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3(exports: dict[str, Exported], tmp_path_factory: pytest.TempPathFactory) -> Exported:
    return _exported("qwen3", exports, tmp_path_factory)


@pytest.fixture(scope="module")
def stub(exported: Exported, loop: LoopThread) -> Iterator[pb_grpc.TextGenerationStub]:
    running = RunningServer(loop, loopback_settings(exported.bundle, engine_process=False))
    try:
        with grpc.insecure_channel(running.target) as channel:
            yield pb_grpc.TextGenerationStub(channel)
    finally:
        running.stop()


def _generate(stub: pb_grpc.TextGenerationStub, text: str, **stopping: Any) -> pb.GenerateResponse:
    criteria = pb.StoppingCriteria(max_new_tokens=STEPS, **stopping)
    return stub.Generate(pb.GenerateRequest(text=text, stopping=criteria))


def test_batched_greedy_tokens_equal_transformers_generate(
    exported: Exported, stub: pb_grpc.TextGenerationStub
) -> None:
    with ThreadPoolExecutor(len(TEXTS)) as pool:  # in flight together: decoded in one batch
        replies = list(pool.map(lambda t: _generate(stub, t, ignore_eos=True), TEXTS))
    for text, reply in zip(TEXTS, replies, strict=True):
        ids = exported.tokenizer(text).input_ids
        assert list(stub.Tokenize(pb.TokenizeRequest(text=text)).ids) == ids
        expected = hf_greedy(exported.model, ids).tokens[0].tolist()
        assert list(reply.token_ids) == expected, text
        assert reply.usage.prompt_tokens == len(ids)


def test_text_tokenizes_as_the_hf_tokenizer(exported: Exported, stub: pb_grpc.TextGenerationStub) -> None:
    for text in (*TEXTS, "héllo wörld", "  two  spaces\nand a line"):
        ids = exported.tokenizer(text).input_ids
        assert list(stub.Tokenize(pb.TokenizeRequest(text=text)).ids) == ids
    bos = exported.family.id(exported.family.bos)
    starts_with_bos = exported.tokenizer("the").input_ids[0] == bos
    assert starts_with_bos is exported.family.adds_bos  # Llama and Mistral add BOS, the others do not


def test_model_info_and_manifest(exported: Exported, stub: pb_grpc.TextGenerationStub) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert list(info.eos_token_ids) == exported.eos_ids and info.eos_token_id == exported.eos_ids[0]
    assert info.max_model_len == info.context_length == 128  # the model's context: under the default cap
    manifest = load_bundle(exported.bundle).manifest
    assert manifest.format_version == 2 and manifest.eos_token_ids == exported.eos_ids
    assert manifest.bos_token_id == exported.family.id(exported.family.bos)
    assert manifest.chat_template == exported.family.chat_template
    arch, config = manifest.architecture, exported.model.config
    assert arch.n_kv_heads == getattr(config, "num_key_value_heads", arch.n_heads)
    report = manifest.verification
    assert report["passed"] and report["reference"] == "transformers"
    assert report["inplace"]["max_abs_logits_diff"] <= 1e-4 and report["inplace"]["greedy_identical"]
    assert report["standard"]["batch_invariant"]


def test_every_eos_id_ends_a_generation(exported: Exported, stub: pb_grpc.TextGenerationStub) -> None:
    first, second = exported.eos_ids
    ids = exported.tokenizer(TEXTS[0]).input_ids
    _, k = _second_eos(exported.model, ids, first)
    reply = _generate(stub, TEXTS[0])
    assert reply.finish_reason == pb.FINISH_REASON_EOS and len(reply.token_ids) == k  # EOS not returned
    banned = _generate(stub, TEXTS[0], min_new_tokens=k + 2)
    assert len(banned.token_ids) >= k + 2
    assert not {first, second} & set(banned.token_ids[: k + 2])


# -- bad inputs: exit 1, one line naming the file ---------------------------------------------------------


@pytest.fixture
def llama_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "llama"
    build(FAMILIES["llama"].make_config(), folder)
    FAMILIES["llama"].save_tokenizer(folder)
    return folder


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["hf", *argv]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("textgen-export hf: ")
    return lines[0]


def _damage_weights(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"\x07" * 64)


def _drop_tensor(folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (
            lambda f: rewrite_config(f, lambda c: {**c, "architectures": ["FalconForCausalLM"]}),
            "config.json: architecture 'FalconForCausalLM' is not supported",
        ),
        (lambda f: (f / "model.safetensors").unlink(), "model.safetensors: not found"),
        (_damage_weights, "model.safetensors: not a readable safetensors file"),
        ((lambda f: (f / "tokenizer.json").unlink()), "tokenizer.json: not found"),
        (
            lambda f: rewrite_config(f, lambda c: {**c, "hidden_size": 96}),
            "config does not match the weights",
        ),
        (_drop_tensor, "lack 'model.layers.0.self_attn.k_proj.weight'"),
    ],
    ids=[
        "architecture",
        "no-weights",
        "corrupt-weights",
        "no-tokenizer",
        "config-mismatch",
        "missing-tensor",
    ],
)
def test_bad_inputs_exit_1_with_one_line(
    llama_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: Any, expected: str
) -> None:
    damage(llama_folder)
    line = _refused(["--model", str(llama_folder), "--out", str(tmp_path / "b")], capsys)
    assert expected in line and str(llama_folder) in line
    assert not (tmp_path / "b").exists()


def test_a_hub_id_resolves_through_the_local_cache(
    llama_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """huggingface_hub's cache layout: models--ORG--NAME/{refs/main, snapshots/COMMIT/...}."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(llama_folder, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert locate_model("tiny-org/tiny-llama") == snapshot
    line = _refused(["--model", "tiny-org/not-fetched", "--out", str(tmp_path / "b")], capsys)
    assert "not in the Hugging Face cache" in line and str(cache) in line
    assert "huggingface-cli download tiny-org/not-fetched" in line and "hf download" in line
    assert "no such folder" in _refused(
        ["--model", str(tmp_path / "a/b/c"), "--out", str(tmp_path / "b")], capsys
    )


def test_fp16_bundle_is_checked_against_transformers(qwen3: Exported, tmp_path: Path) -> None:
    """FP16: the standard graph on CPU against transformers (the demo model's report); the serving graph's
    RMSNorm conversion passes onnx's checker and strict shape inference. One family is enough: Qwen3 has
    every RMSNorm, the per-head ones too."""
    assert main(["hf", "--model", str(qwen3.folder), "--out", str(tmp_path / "fp16"), "--fp16"]) == 0
    fp16 = load_bundle(tmp_path / "fp16").manifest
    assert fp16.dtype == "float16" and fp16.verification["passed"]
    assert fp16.verification["standard"]["greedy_identical"] and fp16.verification["tolerance"] == 5e-2


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_bundle_is_judged_on_accuracy(
    qwen2: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """The demo model's accuracy report (held-out perplexity and top-1 agreement against our fp32 decoder,
    greedy agreement, every weight MatMul quantized), the graphs checked against transformers, the serving
    graph batch invariant; and again by `verify --hf-model`. One family is enough: quantization does not
    depend on it."""
    bundle = tmp_path / kind
    assert main(["hf", "--model", str(qwen2.folder), "--out", str(bundle), f"--{kind}"]) == 0
    manifest = load_bundle(bundle).manifest
    report = manifest.verification
    assert report["passed"] and report["reference"] == "transformers" and report["tolerance"] is None
    assert manifest.batch_invariant and report["inplace"]["batch_invariant"]
    quant = report[kind]
    assert quant["float_weight_matmuls"] == 0 and quant["weight_matmuls"]["inplace"]["quantized"] > 0
    limit = quant["max_perplexity_ratio"]
    assert quant["perplexity_ratio"] <= limit if kind == "int8" else limit is None
    assert quant["heldout_tokens"] > 0
    assert report["standard"]["finite"] and report["inplace"]["finite"]
    capsys.readouterr()
    assert main(["verify", str(bundle), "--hf-model", str(qwen2.folder)]) == 0
    assert f"{kind} accuracy  perplexity fp32" in capsys.readouterr().out


def test_verify_reruns_the_checks_against_transformers(
    qwen2: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`textgen-export verify BUNDLE --hf-model DIR`: the write-time checks again; other weights of the same
    shape fail them, another shape is refused before any work, on one line."""
    assert main(["verify", str(qwen2.bundle), "--hf-model", str(qwen2.folder)]) == 0
    out = capsys.readouterr().out
    assert "verification against transformers" in out and "PASSED" in out
    other = tmp_path / "other-seed"
    build(qwen2.family.make_config(), other, seed=SEED + 1)
    qwen2.family.save_tokenizer(other)
    assert main(["verify", str(qwen2.bundle), "--hf-model", str(other)]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "FAILED verification" in captured.err
    rewrite_config(other, lambda c: {**c, "num_hidden_layers": 3})
    assert main(["verify", str(qwen2.bundle), "--hf-model", str(other)]) == 1
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"textgen-export verify: {other}: does not match the bundle at {qwen2.bundle} (n_layers 3 vs 2)"
    )

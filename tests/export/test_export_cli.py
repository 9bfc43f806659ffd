"""`textgen-export`: exit codes and one-line messages for user errors, and the subcommands end to end."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from export.checkpoint import save_checkpoint
from export.cli import build_parser, main
from export.model import Decoder
from export.pipeline import PRESETS
from serve.bundle import load_bundle

# The first test to use the demo fixtures may train (~3 min) and export the demo model.
DEMO_TIMEOUT = pytest.mark.timeout(1200)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_onnx_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["onnx", "--checkpoint", str(tmp_path / "nope.pt"), "--out", str(tmp_path / "b")]
    code, _, err = run(argv, capsys)
    assert code == 1
    line = one_line(err)
    assert "nope.pt" in line and "textgen-export onnx" in line
    assert not (tmp_path / "b").exists()


def test_onnx_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bogus = tmp_path / "bogus.pt"
    bogus.write_bytes(b"definitely not a checkpoint")
    code, _, err = run(["onnx", "--checkpoint", str(bogus), "--out", str(tmp_path / "b")], capsys)
    assert code == 1 and "bogus.pt" in one_line(err)


@pytest.mark.parametrize(
    "argv",
    [
        ["onnx", "--checkpoint", "c.pt", "--out", "b", "--opset", "12"],
        ["random", "--preset", "gpt-5", "--out", "b"],
        ["frobnicate"],
        ["onnx", "--checkpoint", "c.pt", "--out", "b", "--int4", "--block-size", "big"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_verify_passes_on_a_good_bundle(tiny_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["verify", str(tiny_bundle)], capsys)
    assert code == 0, err
    assert "PASSED" in out and "standard graph" in out and "serving graph" in out


def test_verify_refuses_a_corrupt_bundle(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = Path(shutil.copytree(tiny_bundle, tmp_path / "b"))
    with (root / "model_inplace.onnx").open("ab") as f:
        f.write(b"junk")
    code, _, err = run(["verify", str(root)], capsys)
    assert code == 1
    line = one_line(err)
    assert "model_inplace.onnx" in line and "checksum mismatch" in line


def test_verify_missing_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["verify", str(tmp_path / "absent")], capsys)
    assert code == 1 and "does not exist" in one_line(err)


def test_verify_against_a_checkpoint_of_another_model(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = PRESETS["tiny"].__class__(**{**PRESETS["tiny"].to_dict(), "d_model": 64})
    tokenizer = load_bundle(tiny_bundle).tokenizer
    ckpt = save_checkpoint(tmp_path / "other.pt", Decoder(other), tokenizer, {})
    code, _, err = run(["verify", str(tiny_bundle), "--checkpoint", str(ckpt)], capsys)
    assert code == 1
    line = one_line(err)
    assert "does not match the bundle" in line and "d_model 64 vs 32" in line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--int4", "--int8"], "--int8 and --int4 each make a bundle of their own"),
        (["--int4", "--fp16"], "--int4 and --fp16 each make a bundle of their own"),
        (["--int8", "--fp16"], "choose one"),
        (["--int4", "--block-size", "48"], "block size must be a power of two >= 16"),
        (["--int4", "--block-size", "8"], "block size must be a power of two >= 16"),
        (["--block-size", "32"], "--block-size applies to --int8 and --int4"),
    ],
)
def test_precision_flag_errors_exit_1_with_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(
        ["onnx", "--checkpoint", str(tmp_path / "c.pt"), "--out", str(tmp_path / "b"), *argv], capsys
    )
    assert code == 1 and message in one_line(err)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    ("flag", "scheme"), [("--int8", "MatMulNBits, block 64"), ("--int4", "MatMulNBits, block 32")]
)
def test_onnx_end_to_end_quantized(
    flag: str, scheme: str, tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(1)
    tokenizer = load_bundle(tiny_bundle).tokenizer
    ckpt = save_checkpoint(tmp_path / "tiny.pt", Decoder(PRESETS["tiny"]), tokenizer, {})
    out = tmp_path / "bundle"
    # The int4 run measures perplexity on a text of the user's (this file) instead of the stdlib's.
    eval_text = ["--eval-text", __file__] if flag == "--int4" else []
    code, stdout, err = run(["onnx", "--checkpoint", str(ckpt), "--out", str(out), flag, *eval_text], capsys)
    assert code == 0, err
    kind = flag.removeprefix("--")
    assert (
        "PASSED" in stdout
        and f"quantized ({scheme}): standard 9/9, inplace 9/9; embeddings quantized: standard 1, inplace 1"
        in stdout
    )
    assert f"{kind} accuracy" in stdout and f"bundle written to {out}" in stdout
    bundle = load_bundle(out)
    assert bundle.manifest.quantization == kind and bundle.manifest.model_name == "tiny"
    assert bundle.manifest.batch_invariant
    accuracy = bundle.manifest.verification[kind]
    assert accuracy["heldout_text"] == ("eval text" if eval_text else "stdlib held-out split")
    assert 0 <= accuracy["top1_agreement"] <= 1 and accuracy["perplexity_ratio"] > 0
    # verify reruns the checks and the accuracy report from the bundle and the checkpoint alone.
    code, stdout, err = run(["verify", str(out), "--checkpoint", str(ckpt), *eval_text], capsys)
    assert code == 0, err
    limit = "limit x1.02" if kind == "int8" else "reported, no limit"
    assert "PASSED" in stdout and f"{kind} accuracy  perplexity" in stdout and limit in stdout
    assert bundle.manifest.verification["export"]["source"]["checkpoint"] == str(ckpt)
    assert not list(tmp_path.glob(".bundle.tmp-*"))  # nothing left staged


def test_onnx_refuses_to_overwrite_a_non_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.py").write_text("print('hi')")
    ckpt = tmp_path / "x.pt"
    ckpt.write_bytes(b"")  # never read: the --out check comes first
    code, _, err = run(["onnx", "--checkpoint", str(ckpt), "--out", str(tmp_path / "src")], capsys)
    assert code == 1 and "refusing to replace" in one_line(err)
    assert (tmp_path / "src" / "main.py").exists()


@DEMO_TIMEOUT
def test_demo_reuses_an_up_to_date_bundle(demo_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["demo", "--out", str(demo_bundle)], capsys)
    assert code == 0, err
    assert "up to date" in out


@DEMO_TIMEOUT
def test_verify_demo_bundle_against_its_checkpoint(
    demo_bundle: Path, demo_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["verify", str(demo_bundle), "--checkpoint", str(demo_checkpoint)], capsys)
    assert code == 0, err
    assert "verification against pytorch" in out and "PASSED" in out


def test_inspect_is_registered_when_present() -> None:
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"onnx", "demo", "verify", "random"} <= set(subcommands)
    assert "inspect" in subcommands


def test_python_dash_m_export_prints_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "export", "verify", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "does not exist" in one_line(proc.stderr)


@pytest.mark.slow
def test_random_bench_a_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["random", "--preset", "bench-a", "--out", str(tmp_path / "bench-a")], capsys)
    assert code == 0, err
    assert "PASSED" in out
    arch = load_bundle(tmp_path / "bench-a").manifest.architecture
    assert (arch.vocab_size, arch.d_model, arch.n_layers, arch.context_length) == (8192, 512, 8, 1024)

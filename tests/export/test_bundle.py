"""The bundle format: round trip, format 1 bundles read as before, and every way a bundle can be refused with
a clear BundleError."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from serve.bundle import MANIFEST_FILE, Bundle, Manifest, ShapeRange, load_bundle, sha256_file
from serve.errors import BundleError


@pytest.fixture
def bundle_copy(tiny_bundle: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny bundle that a test may damage."""
    return Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))


def edit_manifest(root: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = root / MANIFEST_FILE
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def refused(root: Path) -> str:
    with pytest.raises(BundleError) as info:
        load_bundle(root)
    return str(info.value)


def test_round_trip(tiny_bundle: Path) -> None:
    bundle = load_bundle(tiny_bundle)
    m = bundle.manifest
    assert isinstance(bundle, Bundle)
    assert m.format_version == 2 and m.dtype == "float32" and m.quantization == "none"
    arch = m.architecture
    assert (arch.n_layers, arch.n_heads, arch.n_kv_heads, arch.head_dim) == (2, 2, 2, 16)
    assert (arch.norm, arch.sliding_window) == ("layer", 0)
    assert bundle.standard_graph == tiny_bundle / "model.onnx" and bundle.standard_graph.is_file()
    assert bundle.inplace_graph is not None and bundle.inplace_graph.is_file()
    assert m.graphs.standard.inputs[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert m.graphs.standard.outputs[0] == "logits"
    assert set(m.checksums) == {"model.onnx", "model_inplace.onnx", "weights.data", "tokenizer.json"}
    assert all(sha256_file(tiny_bundle / f) == digest for f, digest in m.checksums.items())
    assert bundle.tokenizer.token_to_id("<|endoftext|>") == m.eos_token_id
    assert m.eos_token_ids == [m.eos_token_id] and m.bos_token_id is None
    assert bundle.tokenizer.token_to_id("<|pad|>") == m.pad_token_id
    assert m.verification["passed"] is True
    # What is written reads back identically.
    assert Manifest.model_validate_json(m.model_dump_json()) == m


def test_tensorrt_options_cover_every_input(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = load_bundle(tiny_bundle)
    options = bundle.tensorrt_options(tmp_path)
    assert options["trt_engine_cache_path"] == str(tmp_path / bundle.manifest.tensorrt.engine_cache_dir)
    ctx = bundle.manifest.architecture.context_length
    for which in ("min", "opt", "max"):
        shapes = dict(item.split(":") for item in options[f"trt_profile_{which}_shapes"].split(","))
        assert set(shapes) == set(bundle.manifest.graphs.standard.inputs)
    maxes = dict(item.split(":") for item in options["trt_profile_max_shapes"].split(","))
    assert maxes["input_ids"] == f"16x{ctx}"
    assert maxes["past_key_values.1.value"] == f"16x2x{ctx - 1}x16"
    mins = dict(item.split(":") for item in options["trt_profile_min_shapes"].split(","))
    assert mins["past_key_values.0.key"] == "1x2x0x16"  # prefill: empty past


def test_missing_directory(tmp_path: Path) -> None:
    message = refused(tmp_path / "nowhere")
    assert "nowhere" in message and "does not exist" in message


def test_missing_manifest(bundle_copy: Path) -> None:
    (bundle_copy / MANIFEST_FILE).unlink()
    assert "manifest missing" in refused(bundle_copy)


def test_manifest_not_json(bundle_copy: Path) -> None:
    (bundle_copy / MANIFEST_FILE).write_text("{ not json")
    message = refused(bundle_copy)
    assert MANIFEST_FILE in message and "not readable JSON" in message


def test_unsupported_format_version(bundle_copy: Path) -> None:
    edit_manifest(bundle_copy, lambda d: d.update(format_version=3))
    message = refused(bundle_copy)
    assert "unsupported bundle format version 3" in message and "reads 1 and 2" in message


FIELDS_ADDED_WITH_INT4 = ("quantization_block_size", "batch_invariant", "odd_rows_padded")


def as_format_1(data: dict[str, Any]) -> None:
    """A format 2 manifest of this project's decoder rewritten as format 1 wrote it (with the optional chat
    template that format 1 bundles of the demo carry)."""
    data["format_version"] = 1
    added = (
        "n_kv_heads",
        "norm",
        "sliding_window",
        "n_experts",
        "experts_top_k",
        "expert_d_ff",
        "sparse_layers",
    )
    for key in added:
        del data["architecture"][key]
    data["eos_token_id"] = data.pop("eos_token_ids")[0]
    for key in ("bos_token_id", "lora", *FIELDS_ADDED_WITH_INT4):
        del data[key]


def test_format_1_manifest_loads_as_before(bundle_copy: Path, tiny_bundle: Path) -> None:
    edit_manifest(bundle_copy, as_format_1)
    old, new = load_bundle(bundle_copy).manifest, load_bundle(tiny_bundle).manifest
    assert old.format_version == 1
    assert old.model_dump(exclude={"format_version"}) == new.model_dump(exclude={"format_version"})
    assert old.eos_token_ids == [old.eos_token_id] and old.architecture.n_kv_heads == old.architecture.n_heads
    assert Manifest.model_validate_json(old.model_dump_json()) == old


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: d["architecture"].update(n_heads=3), "must equal d_model"),  # format 1's rule
        (lambda d: d["architecture"].update(n_kv_heads=1), "Extra inputs are not permitted"),
        (lambda d: d.update(eos_token_ids=[0, 1]), "Extra inputs are not permitted"),
        (lambda d: d["architecture"].update(activation="swiglu"), "activation"),
        (lambda d: d.update(eos_token_id=10_000), "must be below vocab_size"),
    ],
)
def test_format_1_manifest_is_checked_as_format_1(
    bundle_copy: Path, change: Callable[[dict[str, Any]], None], expected: str
) -> None:
    edit_manifest(bundle_copy, lambda d: (as_format_1(d), change(d)))
    message = refused(bundle_copy)
    assert "invalid manifest" in message and expected in message


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: d["architecture"].update(n_kv_heads=3), "must divide n_heads"),
        (lambda d: d.update(dtype="int4"), "dtype"),
        (lambda d: d.update(quantization="int3"), "quantization"),
        (lambda d: d.update(quantization_block_size=0), "quantization_block_size"),
        (lambda d: d.update(surprise=1), "Extra inputs are not permitted"),
        (lambda d: d.update(eos_token_id=0), "Extra inputs are not permitted"),  # format 1's key
        (lambda d: d.update(eos_token_ids=[0, 10_000]), "must be below vocab_size"),
        (lambda d: d.update(eos_token_ids=[]), "eos_token_ids"),
        (lambda d: d.update(eos_token_ids=[0, 0]), "lists an id twice"),
        (lambda d: d.update(bos_token_id=10_000), "bos_token_id (10000) must be below vocab_size"),
        (lambda d: d.update(chat_template=""), "chat_template"),
        (lambda d: d["graphs"]["standard"].update(file="../model.onnx"), "plain file name"),
        (lambda d: d["checksums"].pop("tokenizer.json"), "files without a checksum"),
        (lambda d: d["checksums"].update({"model.onnx": "abc"}), "not a lowercase sha256"),
        (lambda d: d["tensorrt"]["profile"]["batch"].update(min=32), "min <= opt <= max"),
    ],
)
def test_invalid_manifest(bundle_copy: Path, change: Callable[[dict[str, Any]], None], expected: str) -> None:
    edit_manifest(bundle_copy, change)
    message = refused(bundle_copy)
    assert "invalid manifest" in message and expected in message


def test_checksum_mismatch_of_the_tokenizer_refuses_the_bundle(bundle_copy: Path) -> None:
    with (bundle_copy / "tokenizer.json").open("ab") as f:
        f.write(b" ")
    message = refused(bundle_copy)
    assert "tokenizer.json" in message and "checksum mismatch" in message


@pytest.mark.parametrize("graph", ["standard", "inplace"])
def test_a_changed_graph_is_refused_when_first_asked_for(bundle_copy: Path, graph: str) -> None:
    name = {"standard": "model.onnx", "inplace": "model_inplace.onnx"}[graph]
    with (bundle_copy / name).open("ab") as f:
        f.write(b"\0")
    bundle = load_bundle(bundle_copy)  # no graph is hashed before it is opened
    for _ in range(2):  # refused every time it is asked for, never handed out unchecked
        with pytest.raises(BundleError) as info:
            getattr(bundle, f"{graph}_graph")
        message = str(info.value)
        assert str(bundle_copy / name) in message and "checksum mismatch" in message
    other = "inplace" if graph == "standard" else "standard"
    assert getattr(bundle, f"{other}_graph").is_file()


def test_each_file_is_hashed_once_when_first_opened(
    tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed: list[str] = []

    def recorded(path: Path) -> str:
        hashed.append(path.name)
        return sha256_file(path)

    monkeypatch.setattr("serve.bundle.sha256_file", recorded)
    bundle = load_bundle(tiny_bundle)
    assert hashed == ["tokenizer.json"]
    for _ in range(2):
        assert bundle.inplace_graph == tiny_bundle / "model_inplace.onnx"
    assert hashed == ["tokenizer.json", "model_inplace.onnx", "weights.data"]
    assert bundle.standard_graph == tiny_bundle / "model.onnx"  # the weights both graphs read: hashed once
    assert hashed == ["tokenizer.json", "model_inplace.onnx", "weights.data", "model.onnx"]


def test_missing_file(bundle_copy: Path) -> None:
    (bundle_copy / "tokenizer.json").unlink()
    message = refused(bundle_copy)
    assert "tokenizer.json" in message and "missing" in message


def test_corrupt_tokenizer_with_matching_checksum(bundle_copy: Path) -> None:
    tok = bundle_copy / "tokenizer.json"
    tok.write_text('{"version": "1.0"}')
    edit_manifest(bundle_copy, lambda d: d["checksums"].update({"tokenizer.json": sha256_file(tok)}))
    message = refused(bundle_copy)
    assert "tokenizer.json" in message and "not a valid tokenizers file" in message


def test_shape_range_rejects_disorder() -> None:
    with pytest.raises(ValueError, match="min <= opt <= max"):
        ShapeRange(min=4, opt=2, max=8)


def test_a_bundle_written_before_chat_templates_loads_and_a_demo_one_is_stale(bundle_copy: Path) -> None:
    from export.demo import DEMO_CHAT_TEMPLATE
    from export.pipeline import _up_to_date

    source = load_bundle(bundle_copy).manifest.verification["export"]["source"]
    assert load_bundle(bundle_copy).manifest.chat_template == DEMO_CHAT_TEMPLATE  # random bundles carry it
    assert _up_to_date(bundle_copy, source, DEMO_CHAT_TEMPLATE) is not None
    path = bundle_copy / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    del manifest["chat_template"]
    path.write_text(json.dumps(manifest))
    assert load_bundle(bundle_copy).manifest.chat_template is None
    # ensure_demo_bundle re-exports a demo bundle without the demo's chat template (the next `make serve`).
    assert _up_to_date(bundle_copy, source, DEMO_CHAT_TEMPLATE) is None


def test_format_2_head_dim_need_not_tie_to_d_model(bundle_copy: Path) -> None:
    """Qwen3: 4 heads of 32 on a d_model of 64; the KV cache is sized by n_kv_heads x head_dim."""
    edit_manifest(bundle_copy, lambda d: d["architecture"].update(n_heads=4, n_kv_heads=1, head_dim=32))
    arch = load_bundle(bundle_copy).manifest.architecture
    assert (arch.n_heads, arch.n_kv_heads, arch.head_dim, arch.d_model) == (4, 1, 32, 32)
    assert arch.kv_bytes_per_token(4) == 2 * 2 * 1 * 32 * 4


def test_format_2_n_kv_heads_defaults_to_n_heads(bundle_copy: Path) -> None:
    edit_manifest(bundle_copy, lambda d: d["architecture"].pop("n_kv_heads"))
    arch = load_bundle(bundle_copy).manifest.architecture
    assert arch.n_kv_heads == arch.n_heads == 2


@pytest.mark.parametrize(("quantization", "invariant"), [("none", True), ("int8", False)])
def test_a_manifest_written_before_batch_invariance_was_recorded(
    bundle_copy: Path, quantization: str, invariant: bool
) -> None:
    """Float bundles were verified batch invariant; INT8 ones then were dynamic INT8, which is not."""

    def older(data: dict[str, Any]) -> None:
        for key in FIELDS_ADDED_WITH_INT4:
            del data[key]
        data["quantization"] = quantization

    edit_manifest(bundle_copy, older)
    m = load_bundle(bundle_copy).manifest
    assert m.batch_invariant is invariant and m.quantization_block_size is None


def test_an_int4_manifest_reads_back(bundle_copy: Path) -> None:
    int4 = {"quantization": "int4", "quantization_block_size": 32, "odd_rows_padded": True}
    edit_manifest(bundle_copy, lambda d: d.update(int4))
    m = load_bundle(bundle_copy).manifest
    assert (m.quantization, m.quantization_block_size, m.batch_invariant) == ("int4", 32, True)
    assert Manifest.model_validate_json(m.model_dump_json()) == m


def test_a_matmulnbits_manifest_without_padded_rows_is_not_claimed_batch_invariant(bundle_copy: Path) -> None:
    """Written before the pad: verified invariant on its export machine, which another CPU need not repeat."""

    def older(data: dict[str, Any]) -> None:
        del data["odd_rows_padded"]
        data.update(quantization="int8", quantization_block_size=64)

    edit_manifest(bundle_copy, older)
    m = load_bundle(bundle_copy).manifest
    assert m.quantization_block_size == 64 and not m.odd_rows_padded and not m.batch_invariant


NOBODY = 65534  # not the exporting user: the serving image runs as another one (user 10001 in deploy/)


def test_a_bundle_exported_by_one_user_is_read_by_another() -> None:
    """A bundle exported on a host (by root, umask 022) and mounted read-only into the serving image is read
    by another user: its folder and files get the modes the umask allows, not a temp folder's 0700."""
    from export.pipeline import random_bundle

    # Not tmp_path: pytest's base folder is 0700, which would keep the other user out whatever the bundle's
    # modes; this folder stands for the host folder mounted into the pod.
    mount = Path(tempfile.mkdtemp(prefix="textgen-mount-"))
    old_umask = os.umask(0o022)
    try:
        mount.chmod(0o755)
        root = random_bundle("tiny", mount / "bundle", seed=0, progress=False).root
        os.umask(old_umask)
        assert stat.S_IMODE(root.stat().st_mode) == 0o755
        files = sorted(p for p in root.iterdir())
        assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in files)
        if os.geteuid() != 0:
            return  # reading as another user needs root to become one; the modes above are what it reads by
        checksums = Manifest.model_validate_json((root / MANIFEST_FILE).read_text()).checksums
        names = sorted(checksums)
        done = subprocess.run(
            ["sha256sum", *names], cwd=root, user=NOBODY, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
        read = {line.split()[1]: line.split()[0] for line in done.stdout.splitlines()}
        assert read == checksums
    finally:
        os.umask(old_umask)
        shutil.rmtree(mount, ignore_errors=True)

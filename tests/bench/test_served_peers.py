"""The served-against-served benchmark's parts: llama-batched-bench's table read, the round order, the
report on hand-made records, and a served cell of a real textgen-serve over HTTP (the load generator
without gRPC)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from bench import llama_cpp
from bench.scenarios import served_peers
from bench.scenarios.served_peers import Workload, order, prompts, ratio_median, report
from bench.servers import free_port
from serve.bundle import load_bundle

BATCHED_BENCH_OUT = """
main: n_kv_max = 2624, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, n_gpu_layers = -1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |    128 |    1 |    160 |    0.250 |   128.00 |    1.500 |    85.33 |    1.750 |    91.43 |
|    32 |    128 |    4 |    640 |    0.800 |   160.00 |    3.200 |   160.00 |    4.000 |   160.00 |

llama_perf_context_print:        load time =     123.45 ms
"""


def test_batched_bench_rows_and_their_new_token_rate() -> None:
    rows = llama_cpp.parse_batched_bench(BATCHED_BENCH_OUT)
    assert [(r.prompt, r.new, r.batch) for r in rows] == [(32, 128, 1), (32, 128, 4)]
    assert rows[0].prefill_s == 0.25 and rows[0].decode_s == 1.5 and rows[0].total_s == 1.75
    # new tokens over the whole run (prefill included), not the table's S t/s (which counts the prompt too)
    assert rows[0].tok_s == pytest.approx(128 / 1.75)
    assert rows[1].tok_s == pytest.approx(128 * 4 / 4.0)
    assert llama_cpp.parse_batched_bench("no table here") == []


# A stand-in for llama.cpp's converter: its TextModel's BPE vocabulary reader, and a script that calls it.
FAKE_BASE = """
class TextModel:
    def __init__(self, dir_model):
        self.dir_model = dir_model
    def _set_vocab_gpt2(self):
        print("bpe")
    def _set_vocab_sentencepiece(self):
        print("sentencepiece")
"""
FAKE_CONVERTER = """
import sys
from conversion.base import TextModel
TextModel(sys.argv[1])._set_vocab_gpt2()
"""


@pytest.mark.parametrize(("tokenizer_file", "read_as"), [("tokenizer.model", "sentencepiece"), (None, "bpe")])
def test_the_converter_reads_a_sentencepiece_tokenizer_where_it_would_ask_for_bpe(
    tmp_path: Path, tokenizer_file: str | None, read_as: str
) -> None:
    src, model = tmp_path / "llama.cpp", tmp_path / "model"
    (src / "conversion").mkdir(parents=True)
    (src / "conversion" / "__init__.py").write_text("")
    (src / "conversion" / "base.py").write_text(FAKE_BASE)
    (src / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    model.mkdir()
    if tokenizer_file:
        (model / tokenizer_file).write_bytes(b"a SentencePiece model")
    done = subprocess.run(
        [sys.executable, "-c", llama_cpp.CONVERT, str(src), str(model)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [read_as]


def test_server_commands_share_the_slots_context_and_threads(tmp_path: Path) -> None:
    work = Workload(slots=8, ctx_per_slot=128, threads=3)
    theirs = served_peers.llama_command(tmp_path, tmp_path / "m.gguf", 9000, work, [])
    assert theirs[theirs.index("-np") + 1] == "8"
    assert theirs[theirs.index("-c") + 1] == str(8 * 128)  # one context shared by the slots
    assert theirs[theirs.index("-t") + 1] == theirs[theirs.index("-tb") + 1] == "3"
    ours = served_peers.textgen_command(tmp_path, 9001, work, ["--no-spinning"])
    assert ours[ours.index("--max-batch-size") + 1] == "8"
    assert ours[ours.index("--max-model-len") + 1] == "128"
    assert ours[ours.index("--threads") + 1] == "3"
    assert ours[-1] == "--no-spinning"


def test_the_first_server_alternates_by_round_and_by_precision() -> None:
    assert order(0, 0) == ("textgen", "llama-server")
    assert order(1, 0) == ("llama-server", "textgen")
    assert order(0, 1) == order(1, 0)
    firsts = [order(r, 0)[0] for r in range(4)]
    assert firsts.count("textgen") == firsts.count("llama-server") == 2


def _record(round_no: int, server: str, precision: str, clients: int, tok_s: float) -> dict[str, object]:
    return {
        "round": round_no,
        "server": server,
        "precision": precision,
        "clients": clients,
        "tok_s": tok_s,
        "ttft_p50_ms": 10.0 * (round_no + 1),
        "ttft_p90_ms": 20.0,
        "itl_p50_ms": 5.0,
        "complete": True,
    }


def test_ratio_is_the_median_of_each_rounds_ratio() -> None:
    ours = [100.0, 50.0, 90.0]
    theirs = [50.0, 100.0, 100.0]  # ratios 2.0, 0.5, 0.9: median 0.9 (the medians' ratio would be 0.9 too,
    records = [_record(r, "textgen", "int4", 1, t) for r, t in enumerate(ours)]  # but not in general)
    records += [_record(r, "llama-server", "int4", 1, t) for r, t in enumerate(theirs)]
    assert ratio_median(records, "int4", 1) == pytest.approx(0.9)
    records.append(_record(3, "textgen", "int4", 1, 1000.0))  # a round the peer lacks is not paired
    assert ratio_median(records, "int4", 1) == pytest.approx(0.9)
    assert math.isnan(ratio_median(records, "int8", 1))


def test_report_tables_name_the_fastest_precision_and_flag_lost_tokens() -> None:
    rates = {("textgen", "int8"): 60.0, ("textgen", "int4"): 50.0}
    rates |= {("llama-server", "int8"): 40.0, ("llama-server", "int4"): 80.0}
    records = [_record(r, s, p, 1, t) for r in range(2) for (s, p), t in rates.items()]
    records[0] = {**records[0], "complete": False}
    text = report({"precisions": ["int8", "int4"], "clients": [1], "served": records})
    assert "| int8 ÷ q8_0 | 1 | 60.0 | 40.0 | **1.50** |" in text
    assert "| int4 ÷ q4_0 | 1 | 50.0 | 80.0 | **0.62** |" in text
    assert "| 1 | int8 60.0 | q4_0 80.0 | **0.75** |" in text  # each server's own fastest
    assert "1 served cells lost requests or tokens" in text


def test_a_served_cell_of_textgen_over_http(tiny_bundle: Path, tmp_path: Path) -> None:
    work = Workload(slots=4, ctx_per_slot=64, threads=1, prompt_len=6, max_tokens=8, vocab=320)
    port = free_port()
    command = served_peers.textgen_command(tiny_bundle, port, work, [])
    cells = served_peers.serve_and_load(command, port, tmp_path / "server.log", [1, 3], work, seed=5)
    assert list(cells) == [1, 3]
    for clients, cell in cells.items():
        assert cell["complete"] and cell["failed"] == 0
        assert cell["tokens"] == clients * work.max_tokens
        assert cell["tok_s"] > 0 and 0 < cell["ttft_p50_ms"] <= cell["ttft_p90_ms"]
        # NaN when a fast tiny model's tokens arrive in one event (the stream coalesces what is ready)
        assert not cell["itl_p50_ms"] <= 0


def test_accuracy_is_read_from_each_bundles_verification(tmp_path: Path) -> None:
    reports = {
        "fp32": {"passed": True, "batch_invariant": True, "inplace": {"max_abs_logits_diff": 2e-5}},
        "int4": {
            "passed": True,
            "batch_invariant": True,
            "inplace": {"max_abs_logits_diff": 1.3},
            "int4": {"perplexity_ratio": 1.034, "top1_agreement": 0.33},
        },
    }
    bundles = {}
    for precision, verification in reports.items():
        bundles[precision] = tmp_path / precision
        bundles[precision].mkdir()
        (bundles[precision] / "manifest.json").write_text(json.dumps({"verification": verification}))
    cells = served_peers.accuracy(bundles)
    assert cells["int4"]["perplexity_ratio"] == 1.034 and cells["fp32"]["perplexity_ratio"] is None
    text = report({"precisions": ["fp32", "int4"], "clients": [1], "accuracy": cells})
    assert "| fp32 | passed | 2e-05 | True | — | — |" in text
    assert "| int4 | passed | 1.3 | True | 1.034 | 0.33 |" in text


def test_corpus_prompts_are_the_bundles_token_ids_of_stdlib_text(tiny_bundle: Path) -> None:
    work = Workload(prompt_len=12, dataset="corpus", tokenizer=str(tiny_bundle / "tokenizer.json"))
    shown = prompts(work, 3, seed=5)
    assert shown == prompts(work, 3, seed=5)  # both servers of a round get the same ids
    tokenizer = load_bundle(tiny_bundle).tokenizer
    for prompt in shown:
        assert prompt.text is None and len(prompt.token_ids) == 12
        assert all(0 <= token < tokenizer.get_vocab_size() for token in prompt.token_ids)
    with pytest.raises(SystemExit, match="tokenizer"):
        prompts(replace(work, tokenizer=None), 1, seed=5)

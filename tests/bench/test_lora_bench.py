"""bench.scenarios.lora: how it starts both servers on the same adapters, and what a slot's arrays weigh."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.scenarios.lora import lora_flag, peer_servers, slot_bytes
from bench.scenarios.served_peers import Workload
from serve.engine.lora import LoraSlots
from serve.lora_layout import LoraBranch, LoraLayout, LoraPart


def test_both_servers_serve_the_adapters_and_name_them_each_its_own_way(tmp_path: Path) -> None:
    adapters = [tmp_path / "a", tmp_path / "b"]
    args = argparse.Namespace(
        bundle=tmp_path / "bundle", adapters=adapters, llama_cpp=tmp_path / "lcpp", gguf=tmp_path / "m.gguf"
    )
    servers = peer_servers(args, 8080, Workload(), [tmp_path / "a.gguf", tmp_path / "b.gguf"])
    textgen, llama = servers["textgen"], servers["llama-server"]
    assert lora_flag(adapters) == ["--lora", f"a={adapters[0].resolve()},b={adapters[1].resolve()}"]
    assert textgen.command[-2:] == lora_flag(adapters)
    assert (textgen.models, textgen.field) == (("a", "b"), "model")
    # scale 0 at start: llama-server gives a request that lists no adapter every adapter loaded at scale 1
    assert llama.command[-2:] == ["--lora-scaled", f"{tmp_path / 'a.gguf'}:0,{tmp_path / 'b.gguf'}:0"]
    assert (llama.models, llama.field) == (("0", "1"), "lora")


def test_a_slot_weighs_its_share_of_every_branchs_arrays() -> None:
    # q/k/v fused: a [8, 3 parts x rank 2], each part's b [rank 2, its 4 outputs]; 4 bytes x (8 x 6 + 2 x 12)
    qkv = LoraBranch(
        projection="blocks.0.attn.qkv",
        in_features=8,
        out_features=12,
        parts=[LoraPart(module=m, start=4 * i, stop=4 * i + 4) for i, m in enumerate(("q", "k", "v"))],
    )
    slots = LoraSlots(LoraLayout(slots=3, max_rank=2, branches=[qkv]))
    assert slot_bytes(slots) == 4 * (8 * 6 + 2 * 12)

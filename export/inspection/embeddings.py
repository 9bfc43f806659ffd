"""Nearest neighbours of tokens in the (tied) token-embedding space, by cosine similarity.

A trained model puts related tokens together (" self" near " cls", digits near digits); a random or broken
one gives neighbours with near-zero similarity and no visible relation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from export.inspection.attention import token_label
from export.model import Decoder
from export.tokenizer import SPECIAL_TOKENS


@dataclass(frozen=True)
class Neighbours:
    token: str
    token_id: int
    neighbours: list[tuple[str, float]]  # (token, cosine similarity), most similar first


def probe_tokens(token_ids: list[int], tokenizer: Tokenizer, count: int) -> list[int]:
    """The first `count` distinct non-special tokens of a text, in order of appearance."""
    special = {tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    return [t for t in dict.fromkeys(token_ids) if t not in special][:count]


@torch.no_grad()
def nearest_neighbours(
    model: Decoder, tokenizer: Tokenizer, token_ids: list[int], k: int = 5
) -> list[Neighbours]:
    table = F.normalize(model.tok_emb.weight.float(), dim=-1)  # [V,D]
    if any(not 0 <= t < table.shape[0] for t in token_ids):
        raise ValueError(f"token ids must lie in [0, {table.shape[0]}), got {token_ids}")
    similarity = table[token_ids] @ table.T  # [N,V]
    # A token is its own nearest neighbour, and the special tokens' embeddings say nothing about text.
    special = [i for i in (tokenizer.token_to_id(t) for t in SPECIAL_TOKENS) if i is not None]
    similarity[:, special] = -torch.inf
    similarity[torch.arange(len(token_ids)), token_ids] = -torch.inf
    scores, ids = similarity.topk(min(k, table.shape[0] - len(special) - 1), dim=-1)
    labelled = [
        [(token_label(tokenizer, int(i)), float(v)) for i, v in zip(row_ids, row_scores, strict=True)]
        for row_ids, row_scores in zip(ids, scores, strict=True)
    ]
    pairs = zip(token_ids, labelled, strict=True)
    return [Neighbours(token_label(tokenizer, t), t, near) for t, near in pairs]

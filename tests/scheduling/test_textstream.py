"""TextStream: streamed text equals the tokenizer's decode, never half a character, stop strings across tokens
held back and cut, and a per-token cost bounded by a small window."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from export.tokenizer import EOS_ID, train_tokenizer
from serve.scheduling.textstream import MAX_UNREAD_TOKENS, REPLACEMENT, TextDelta, TextStream

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "héllo wörld, çà et là, naïve café",
    "日本語のテキスト、東京と京都",
    "emoji 😀 and 🎉 and 👍🏽 in a sentence",
    "def f(x):\n    return x * 2\n",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer(CORPUS * 20, vocab_size=400)


def stream_all(
    tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...] = (), include_stop: bool = False
) -> list[TextDelta]:
    stream = TextStream(tokenizer, stop, include_stop=include_stop)
    deltas = [stream.push(i) for i in ids]
    deltas.append(TextDelta(stream.flush(), stream.stopped))
    assert stream.text == "".join(d.text for d in deltas)
    return deltas


def joined(deltas: list[TextDelta]) -> str:
    return "".join(d.text for d in deltas)


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "naïve café, çà",
        "日本語 and 東京",
        "rare emoji 🦀🦀 🧪 end",
        "skin tone 👍🏽 ok",
        "a\u0301 combining, tab\tnewline\n",
        "",
    ],
)
def test_deltas_and_flush_equal_decode_and_never_split_a_character(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text).ids
    stream = TextStream(tokenizer)
    so_far = ""
    for token in ids:
        delta = stream.push(token)
        assert REPLACEMENT not in delta.text
        so_far += delta.text
        assert text.startswith(so_far)  # what went out is final: never retracted or rewritten
    assert so_far + stream.flush() == tokenizer.decode(ids) == text


def test_a_character_split_over_byte_tokens_comes_out_whole(tokenizer: Tokenizer) -> None:
    crab = "🦀"  # not in the corpus: its 4 bytes are spread over several tokens
    ids = tokenizer.encode(crab).ids
    assert len(ids) >= 3
    stream = TextStream(tokenizer)
    assert [stream.push(i).text for i in ids] == [""] * (len(ids) - 1) + [crab]


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("ab é日本😀🦀\n"), max_size=40))
def test_any_text_round_trips(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text).ids
    assert joined(stream_all(tokenizer, ids)) == text


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_token_sequence_matches_decode_even_invalid_utf8(
    tokenizer: Tokenizer, data: st.DataObject
) -> None:
    # Shorter than the unread-token bound, so the output is exactly what decode gives.
    ids = data.draw(st.lists(st.integers(0, tokenizer.get_vocab_size() - 1), max_size=MAX_UNREAD_TOKENS - 1))
    assert joined(stream_all(tokenizer, ids)) == tokenizer.decode(ids)


def test_flush_releases_an_incomplete_character_as_decode_does(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🦀").ids[:-1]
    stream = TextStream(tokenizer)
    out = "".join(stream.push(i).text for i in ids)
    assert out.startswith("ok") and REPLACEMENT not in out
    rest = stream.flush()
    assert rest.endswith(REPLACEMENT)
    assert out + rest == tokenizer.decode(ids)


def test_stop_string_across_token_boundaries_is_cut_with_what_follows(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello world QXZ and more").ids
    assert len(tokenizer.encode("QXZ").ids) == 3  # unseen letters: the stop string spans three tokens
    stream = TextStream(tokenizer, ("QXZ",))
    deltas = [stream.push(i) for i in ids]
    stopped_at = next(n for n, d in enumerate(deltas) if d.stopped)
    assert joined(deltas[: stopped_at + 1]) == "hello world "
    assert all(d == TextDelta("", True) for d in deltas[stopped_at + 1 :])
    assert stream.flush() == ""
    assert stream.text == "hello world " and stream.stopped


def test_text_that_may_begin_a_stop_string_is_held_until_settled(tokenizer: Tokenizer) -> None:
    stream = TextStream(tokenizer, ("xyz",))
    pushes = [stream.push(i).text for i in tokenizer.encode("axy").ids]
    assert "".join(pushes) == "a"  # "xy" could still become "xyz"
    assert stream.push(tokenizer.encode("q").ids[0]) == TextDelta("xyq", False)
    assert stream.flush() == ""
    held = TextStream(tokenizer, ("xyz",))
    for i in tokenizer.encode("axy").ids:
        held.push(i)
    assert held.flush() == "xy"  # no stop matched: what was held goes out at the end
    assert held.text == "axy" and not held.stopped


def test_the_earliest_stop_string_wins(tokenizer: Tokenizer) -> None:
    stream = TextStream(tokenizer, ("dog", "lazy", "zy d"))
    deltas = [stream.push(i) for i in tokenizer.encode("the lazy dog").ids]
    assert joined(deltas) == "the " and deltas[-1].stopped
    assert stream.stop_string == "lazy"  # the one that ended it, for the API to name


def test_no_stop_string_is_named_until_one_matches(tokenizer: Tokenizer) -> None:
    stream = TextStream(tokenizer, ("dog",))
    for i in tokenizer.encode("the lazy").ids:
        stream.push(i)
    assert stream.stop_string is None and not stream.stopped


def test_a_multibyte_stop_string_split_across_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("rare 🧪🦀 tail").ids
    deltas = stream_all(tokenizer, ids, stop=("🦀",))
    assert joined(deltas) == "rare 🧪" and any(d.stopped for d in deltas)


def test_stop_string_at_the_very_start(tokenizer: Tokenizer) -> None:
    deltas = stream_all(tokenizer, tokenizer.encode("QXZ hello").ids, stop=("QXZ",))
    assert joined(deltas) == "" and deltas[-1].stopped


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("abc é日😀"), max_size=30),
    stop=st.text(alphabet=st.sampled_from("abc é日😀"), min_size=1, max_size=4),
    include=st.booleans(),
)
def test_stop_output_is_the_decoded_text_up_to_the_first_match(
    tokenizer: Tokenizer, text: str, stop: str, include: bool
) -> None:
    """Without `include_stop` the text ends where the stop string begins; with it, where it ends."""
    deltas = stream_all(tokenizer, tokenizer.encode(text).ids, stop=(stop,), include_stop=include)
    cut = text.find(stop)
    assert joined(deltas) == (text if cut < 0 else text[: cut + len(stop) if include else cut])
    assert any(d.stopped for d in deltas) == (cut >= 0)


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("ab c"), max_size=24),
    stop=st.text(alphabet=st.sampled_from("ab c"), min_size=1, max_size=3),
    min_tokens=st.integers(0, 12),
    include=st.booleans(),
)
def test_stop_strings_apply_from_the_min_tokens_th_token_on(
    tokenizer: Tokenizer, text: str, stop: str, min_tokens: int, include: bool
) -> None:
    """Before it, text goes out as it comes; a match must lie in the text of that token and later ones."""
    ids = tokenizer.encode(text).ids
    stream = TextStream(tokenizer, (stop,), include_stop=include, min_tokens=min_tokens)
    deltas = [stream.push(i) for i in ids]
    deltas.append(TextDelta(stream.flush(), stream.stopped))
    before = len(tokenizer.decode(ids[: max(0, min_tokens - 1)]))  # ASCII: token texts add up exactly
    cut = text.find(stop, before)
    assert joined(deltas) == (text if cut < 0 else text[: cut + len(stop) if include else cut])
    assert stream.stopped == (cut >= 0)


def test_included_stop_string_is_the_earliest_then_the_shortest(tokenizer: Tokenizer) -> None:
    text = tokenizer.encode("the lazy dog jumps").ids
    assert joined(stream_all(tokenizer, text, stop=("dog", "lazy", "la"), include_stop=True)) == "the la"
    assert joined(stream_all(tokenizer, text, stop=("dog", "zy d"), include_stop=True)) == "the lazy d"


def test_special_tokens_add_no_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello").ids
    deltas = stream_all(tokenizer, [*ids[:1], EOS_ID, EOS_ID, *ids[1:]])
    assert joined(deltas) == "hello"


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call gets."""

    def __init__(self, inner: Tokenizer) -> None:
        self._inner = inner
        self.widest = 0
        self.calls = 0

    def get_vocab_size(self) -> int:
        return self._inner.get_vocab_size()

    def decode(self, ids: list[int]) -> str:
        self.widest = max(self.widest, len(ids))
        self.calls += 1
        return self._inner.decode(ids)


@pytest.mark.parametrize("text", [*CORPUS, "rare emoji 🦀🦀 🧪 end", ""])
def test_text_read_only_at_the_end_is_decoded_once_and_equals_the_increments(
    tokenizer: Tokenizer, text: str
) -> None:
    ids = [*tokenizer.encode(text).ids, EOS_ID]
    counting = CountingTokenizer(tokenizer)
    deferred = TextStream(counting, incremental=False)  # type: ignore[arg-type]
    assert [deferred.push(i) for i in ids] == [TextDelta("", False)] * len(ids)
    assert counting.calls == 0
    assert deferred.flush() == joined(stream_all(tokenizer, ids)) == text
    assert counting.calls == 1 and deferred.text == text and deferred.flush() == ""


def test_stop_strings_are_matched_as_tokens_come_even_if_text_is_read_at_the_end(
    tokenizer: Tokenizer,
) -> None:
    ids = tokenizer.encode("hello world, the quick brown fox").ids
    stream = TextStream(tokenizer, (" the",), incremental=False)
    deltas = [stream.push(i) for i in ids]
    assert any(d.stopped for d in deltas) and joined(deltas) + stream.flush() == "hello world,"


def test_each_push_decodes_a_bounded_window(tokenizer: Tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    ids = tokenizer.encode(" ".join(CORPUS) * 40).ids + [EOS_ID] * 200
    assert len(ids) > 2000
    stream = TextStream(counting, ("never appears",))  # type: ignore[arg-type]
    out = "".join(stream.push(i).text for i in ids) + stream.flush()
    assert out == tokenizer.decode(ids)
    assert counting.widest <= 8


def test_invalid_bytes_are_emitted_after_a_bounded_wait(tokenizer: Tokenizer) -> None:
    continuation = tokenizer.encode("🦀").ids[1]  # a lone UTF-8 continuation byte: never completes
    counting = CountingTokenizer(tokenizer)
    stream = TextStream(counting)  # type: ignore[arg-type]
    out = "".join(stream.push(continuation).text for _ in range(100))
    assert out.count(REPLACEMENT) > 0
    assert counting.widest <= 2 * MAX_UNREAD_TOKENS


def test_bad_use_is_refused(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        TextStream(tokenizer, ("ok", ""))
    with pytest.raises(TypeError, match="sequence of strings"):
        TextStream(tokenizer, "stop")  # type: ignore[arg-type]
    stream = TextStream(tokenizer)
    vocab = tokenizer.get_vocab_size()
    with pytest.raises(
        ValueError, match=rf"token id {vocab} is outside the vocabulary: allowed 0..{vocab - 1}"
    ):
        stream.push(vocab)
    stream.flush()
    with pytest.raises(RuntimeError, match="after flush"):
        stream.push(5)

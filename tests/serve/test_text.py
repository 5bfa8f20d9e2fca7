"""The server's text stream: whole characters only, a possible start of a stop string held back, the text cut
before the first stop string. A fake tokenizer whose ids decode to fixed pieces."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from kvwall.serve.server import TextStream

PIECES = {0: "ab", 1: "c", 2: "d", 3: "x", 4: "\xe9"}


class Pieces:
    def decode(self, ids):
        text = "".join(PIECES[i] for i in ids)
        return text[:-1] + "\ufffd" if ids and ids[-1] == 4 and len(ids) % 2 else text  # half a character once


def feed(stops, ids):
    ts = TextStream(Pieces(), stops)
    out = []
    for i in ids:
        delta, stopped = ts.add(i)
        out.append(delta)
        if stopped:
            return out, True
    return out + [ts.flush()], False


def test_a_possible_stop_start_is_held_back_then_released():
    assert feed(["cd"], [0, 1, 3]) == (["ab", "", "cx", ""], False)  # "c" waits: it may start "cd"


def test_the_text_ends_before_the_stop_string():
    assert feed(["cd"], [0, 1, 2, 3]) == (["ab", "", ""], True)
    assert feed(["bc"], [0, 1]) == (["a", ""], True)  # "b" was held back, and the stop began there


def test_without_stops_every_piece_goes_out_and_half_characters_wait():
    assert feed([], [0, 1, 2]) == (["ab", "c", "d", ""], False)
    assert feed([], [4, 4]) == (["", "\xe9\xe9", ""], False)

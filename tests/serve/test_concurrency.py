"""Shared state under threads: the tokenizer of a loaded model is used by the service's request
threads at once, some truncating and some not."""

from __future__ import annotations

import threading

from multihead.bench.texts import sentences

LONG = sentences(1, min_words=300, max_words=300, seed=11)[0]


def test_tokenize_with_and_without_truncation_from_many_threads(pretrained):
    """Before the fix, ``_encode`` switched truncation on the one shared tokenizer before every
    call, so a thread asking for the whole text could get another thread's truncated one (16
    wrong lengths in 800 calls when measured). Each call must see only its own setting."""
    full = len(pretrained.tokenizer.encode(LONG).ids)
    assert 256 < full <= 512
    wrong: list[tuple[str, int]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(cut: int | None) -> None:
        start.wait()
        try:
            for _ in range(150):
                got = len(pretrained.tokenize([LONG], truncate_to=cut).tokens[0])
                if got != (full if cut is None else cut):
                    wrong.append((str(cut), got))
        except BaseException as err:  # a borrow error from the Rust tokenizer, if it races
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(cut,)) for cut in (None, 256, None, 100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and wrong == []
    assert len(pretrained.tokenizer.encode(LONG).ids) == full  # the shared one is untouched

"""``multihead kv`` (the long-input harness) and ``multihead bench kv`` on a tiny random Llama
written by transformers: the tasks as generated, the harness's decoding against transformers'
own ``generate`` (full cache) and against ``multihead.hf.compress`` run on the whole prompt
(compressed), and the benchmark's report."""

from __future__ import annotations

import functools
import json
import random
import statistics

import pytest
import torch
import transformers as tf
from models.decoders import build

import multihead.hf as mhf
from multihead import kv
from multihead.apps import kv as app
from multihead.bench import kv as bench

LENGTHS = (96, 128)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build("llama", tmp_path_factory.mktemp("llama"), layers=2)


@pytest.fixture(scope="module")
def loaded(folder):
    return mhf.load_with_tokenizer(folder)


@pytest.mark.parametrize("task", ["passkey", "multikey"])
@pytest.mark.parametrize("length", [700, 1200])
def test_a_task_has_about_the_length_and_holds_its_answer(loaded, task, length):
    _, tokenizer = loaded
    trial = app.make_task(task, tokenizer, length, 0.5, random.Random(1), keys=3)
    count = len(tokenizer(trial.prompt, add_special_tokens=False)["input_ids"])
    filler = len(tokenizer(app._FILLER, add_special_tokens=False)["input_ids"])
    assert length - filler <= count <= length + filler  # whole filler sentences
    assert trial.answer in trial.prompt and trial.prompt.rstrip().endswith("is")
    if task == "multikey":
        assert trial.prompt.count("One of the special magic numbers for") == 3
    else:
        assert len(trial.answer) == 5 and trial.prompt.count(trial.answer) == 2


def test_depth_places_the_needle(loaded):
    _, tokenizer = loaded
    spots = []
    for depth in (0.1, 0.5, 0.9):
        prompt = app.make_task("passkey", tokenizer, 3000, depth, random.Random(2)).prompt
        spots.append(prompt.index("The pass key is") / len(prompt))
    assert spots == sorted(spots) and spots[0] < 0.25 and spots[2] > 0.75


def test_the_harness_decodes_as_generate_and_compress_do(folder, loaded, tmp_path, capsys):
    options = app.KvOptions(model=str(folder), lengths=LENGTHS, keep=(1.0, 0.5),
                            policies=("snapkv", "h2o", "tova", "streaming"), trials=2,
                            out=tmp_path / "out")  # fmt: skip
    result = app.run(options)
    rows = {(r["length"], r["policy"], r["keep"]): r for r in result["rows"]}
    assert len(rows) == 2 * 2 * 4
    assert (tmp_path / "out" / "kv.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "out" / "kv.json").read_text())["rows"] == result["rows"]
    model, tokenizer = loaded
    sdpa, _ = mhf.load_with_tokenizer(folder, attn_implementation="sdpa")
    rng = random.Random(options.seed)
    for length in LENGTHS:
        for t in range(options.trials):
            trial = app.make_task("passkey", tokenizer, length, (t + 0.5) / 2, rng, 4)
            ids = tokenizer(trial.prompt, return_tensors="pt")["input_ids"]
            with torch.inference_mode():
                plain = sdpa.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
                with mhf.compress(model, kv.SnapKV(0.5)):
                    packed = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
            want = tokenizer.decode(plain[0, ids.shape[1] :])
            for name in options.policies:  # keep 1.0: the full cache, whatever the policy
                assert rows[(length, name, 1.0)]["answers"][t] == want
            assert rows[(length, "snapkv", 0.5)]["answers"][t] == tokenizer.decode(
                packed[0, ids.shape[1] :]
            )
            full, half = rows[(length, "h2o", 1.0)], rows[(length, "h2o", 0.5)]
            assert half["cache_mib"] == pytest.approx(full["cache_mib"] / 2, rel=0.02)
    printed = capsys.readouterr().out
    assert "snapkv" in printed and "kv.png" in printed
    # the timings say which decoding path they time
    assert f"ms/step: {result['decoding']}" in printed and "fast_decoding" in result["decoding"]


def test_chunked_cells_decode_as_generate_under_compress_with_chunks(folder, loaded, tmp_path):
    # --chunk: each compressed cell runs its own prompt in chunks; transformers' generate under
    # compress(chunk=) is the reference (its own cache, its own chunked prefill and decoding)
    options = app.KvOptions(model=str(folder), lengths=(200,), keep=(1.0, 0.5), budget=(48,),
                            policies=("snapkv", "h2o"), trials=2, chunk=64,
                            out=tmp_path / "out")  # fmt: skip
    result = app.run(options)
    rows = {(r["length"], r["policy"], r["keep"]): r for r in result["rows"]}
    assert set(rows) == {(200, p, k) for p in ("snapkv", "h2o") for k in (1.0, 0.5, 48)}
    model, tokenizer = loaded
    config = model.config
    per_key = 2 * config.num_key_value_heads * config.head_dim * 4  # keys + values, float32
    rng = random.Random(options.seed)
    for t in range(options.trials):
        trial = app.make_task("passkey", tokenizer, 200, (t + 0.5) / 2, rng, 4)
        ids = tokenizer(trial.prompt, return_tensors="pt")["input_ids"]
        for name, keep in (("snapkv", 48), ("h2o", 0.5), ("snapkv", 0.5)):
            with torch.inference_mode(), mhf.compress(model, kv.policy(name, keep), chunk=64):
                out = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
            got = rows[(200, name, keep)]["answers"][t]
            assert got == tokenizer.decode(out[0, ids.shape[1] :]), (name, keep)
        # the budget's cache after the prompt: 48 keys per layer and KV head
        want = config.num_hidden_layers * 48 * per_key / 2**20
        assert rows[(200, "snapkv", 48)]["cache_mib"] == pytest.approx(want, rel=1e-9)
    assert json.loads((tmp_path / "out" / "kv.json").read_text())["options"]["chunk"] == 64


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lengths", "10"], "--lengths must be token counts >= 64"),
        (["--keep", "0.5,2"], r"--keep takes fractions in \(0, 1\]"),
        (["--keep", "a"], "--keep takes comma-separated numbers"),
        (["--policies", "snapkv,lru"], "--policies takes names from"),
        (["--budget", "64,0"], "--budget takes token counts >= 1"),
        (["--budget", "64,64"], "--budget takes distinct comma-separated numbers"),
    ],
)
def test_bad_grid_options_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        app.KvOptions(**{argv[0][2:]: argv[1]})


@pytest.mark.slow
def test_bench_kv_reports_costs_and_goals(folder, tmp_path):
    options = bench.KvBenchOptions(model=str(folder), prompt=96, context=128, steps=4,
                                   repeats=1, out=tmp_path)  # fmt: skip
    report = bench.run_kv_bench(options, say=lambda line: None)
    assert set(report["prompt"]["seconds"]) == {"plain", "snapkv", "h2o", "eager"}
    texts = [g["text"] for g in report["goals"]]
    assert len(texts) == 6 and all(isinstance(g["met"], bool) for g in report["goals"])
    # bytes measured on the tensors after 4 steps: 36 kept (a quarter of 128 is below the 4
    # sinks and the 32-row window SnapKV always keeps) + 4 new keys, against 128 + 4
    decode = report["decode"]
    assert kv.SnapKV(0.25).budget_for(128) == 36
    assert decode["compressed"]["bytes"] * (128 + 4) == decode["full"]["bytes"] * (36 + 4)
    assert json.loads((tmp_path / "kv.json").read_text())["goals"] == report["goals"]


def test_the_eager_reference_reduces_the_weights_the_kernel_folds(folder):
    """The benchmark's eager contender computes the same window_mass the kernel does."""
    model, _ = mhf.load_with_tokenizer(folder)
    eager, _ = mhf.load_with_tokenizer(folder, attn_implementation="eager")
    ids = torch.randint(3, 250, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        scores = bench._eager_scores(eager, ids, 32)
        with mhf.capture(model, stats=["window_mass"], window=32) as cap:
            model(input_ids=ids, past_key_values=tf.DynamicCache(), use_cache=True)
    for layer, score in enumerate(scores):
        torch.testing.assert_close(cap.stats[layer]["window_mass"], score, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bench_kv_long_table_runs_each_mode_in_its_own_process(folder, tmp_path):
    """The long-document table on the tiny Llama: a row per mode (each its own process), the
    chunked and compressed caches at the budget, the full cache holding every key, in the
    bytes the config gives a key (K and V, every layer and KV head, float32); json and
    figure. One length: a process per mode is most of the test's time."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    head_dim = config.hidden_size // config.num_attention_heads
    per_key = config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * 4
    options = bench.KvBenchOptions(model=str(folder), lengths="160", steps=3, chunk=32,
                                   budget=40, out=tmp_path)  # fmt: skip
    report = bench.run_kv_bench(options, say=lambda line: None)
    rows = {(r["length"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {(160, m) for m in ("full", "compressed", "chunked")}
    assert rows[(160, "full")]["cache_bytes"] == per_key * (160 + 3)  # 3 steps: 3 keys appended
    for mode in ("compressed", "chunked"):
        assert rows[(160, mode)]["cache_bytes"] == per_key * (40 + 3)
        assert rows[(160, mode)]["prompt_s"] > 0 and rows[(160, mode)]["step_ms"] > 0
    assert json.loads((tmp_path / "kv_long.json").read_text())["rows"] == report["rows"]
    assert (tmp_path / "kv_long.png").stat().st_size > 1000


@pytest.mark.parametrize("text", ["", "a,b", "0,100", ",,"])
def test_bench_kv_lengths_are_checked(text):
    if not text:  # empty: the other measurements, not the table
        assert bench.KvBenchOptions().lengths == ""
        return
    with pytest.raises(ValueError, match="--lengths takes comma-separated prompt lengths"):
        bench._parse_lengths(text)


def test_the_flags_policy_names_are_the_librarys():
    # written out in the app so that parsing its flags imports no torch
    assert tuple(kv.POLICIES) == app.POLICIES


@pytest.mark.parametrize(
    "policy",
    [
        kv.ChunkKV(12, window=2, pool=1, sinks=1, span=4),
        kv.SpanKV(12, window=2, pool=1, sinks=1, span=4),
        kv.PyramidKV(12, window=2, pool=1, sinks=1, beta=2),
    ],
    ids=lambda p: p.name,
)
def test_the_shared_prefill_cells_rank_by_the_policys_own_statistic(policy):
    """Each compressed cell's layers equal ``LayerState.from_prompt`` on the statistic the
    policy names (SnapKV's window mass for both), at each layer's place: not the newest
    positions, which is what a statistic looked up by the policy's name gave these two."""
    gen = torch.Generator().manual_seed(4)
    layers, length = 3, 40
    prompt_kv = [(torch.randn(1, 2, length, 4, generator=gen),) * 2 for _ in range(layers)]
    scores = {
        name: [torch.rand(1, 4, length, generator=gen, dtype=torch.float64) for _ in range(layers)]
        for name in ("window_mass", "key_mass", "last")
    }
    valid = torch.ones(1, length, dtype=torch.bool)
    for layer, state in enumerate(app._compressed(policy, prompt_kv, scores)):
        keys, values = prompt_kv[layer]
        want = kv.LayerState.from_prompt(
            policy, keys, values, kv.grouped(scores["window_mass"][layer], 2), valid,
            place=(layer, layers),
        )  # fmt: skip
        assert torch.equal(state.kept(), want.kept())
        newest = kv.LayerState.from_prompt(kv.StreamingLLM(want.length, sinks=1), keys, values,
                                           None, valid)  # fmt: skip
        assert not torch.equal(state.kept(), newest.kept())


SUITE_WORDS = sorted({"".join(random.Random(i).choices("abcdefghij", k=5)) for i in range(300)})


def test_the_suite_scores_each_task_by_string_match_and_averages_them(
    folder, loaded, tmp_path, monkeypatch, capsys
):
    # the tiny model's vocabulary holds no words: the suite's words are given
    monkeypatch.setattr(app.ruler, "vocabulary_words", lambda vocabulary: SUITE_WORDS)
    tasks = ("niah_single", "vt", "cwe")
    options = app.KvOptions(model=str(folder), task="ruler", tasks=tasks, lengths=(160,),
                            keep=(1.0, 0.5), policies=("snapkv", "chunkkv"), trials=2,
                            out=tmp_path / "out")  # fmt: skip
    result = app.run(options)
    rows = {(r["task"], r["policy"], r["keep"]): r for r in result["rows"]}
    assert set(rows) == {
        (t, p, k) for t in tasks for p in ("snapkv", "chunkkv") for k in (1.0, 0.5)
    }
    _, tokenizer = loaded
    count = functools.partial(app._count, tokenizer)
    rng = random.Random(options.seed)
    for task in tasks:  # the same trials again, each answer scored as RULER scores it
        trials = [app.ruler.make(task, SUITE_WORDS, count, 160, rng, (t + 0.5) / 2) for t in (0, 1)]
        for (name, _, _), row in rows.items():
            if name == task:
                want = sum(app.ruler.score(t, a) for t, a in zip(trials, row["answers"]))
                assert row["correct"] == pytest.approx(want) and row["trials"] == 2
    for average in result["averages"]:
        want = statistics.fmean(rows[(t, average["policy"], average["keep"])]["accuracy"]
                                for t in tasks)  # fmt: skip
        assert average["accuracy"] == pytest.approx(want) and average["tasks"] == 3
    assert result["tasks"] == list(tasks) and result["query_agnostic"] is False
    assert (tmp_path / "out" / "kv.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "average over the 3 tasks" in printed and "question in the prompt" in printed


def test_query_agnostic_cells_compress_the_context_before_the_question(folder, loaded, tmp_path):
    """--query-agnostic: the context's prompt runs alone and is compressed; the question then
    runs on the kept cache (under the policy, as a later chunk does), and the answer follows.
    The references: sdpa's generate on context + question (the full cache), and transformers'
    model under compress, fed the context, then the question, then greedy tokens."""
    options = app.KvOptions(model=str(folder), task="multikey", lengths=(200,), keep=(1.0, 0.5),
                            policies=("snapkv",), trials=2, query_agnostic=True,
                            out=tmp_path / "out")  # fmt: skip
    result = app.run(options)
    assert result["query_agnostic"] is True
    rows = {r["keep"]: r for r in result["rows"]}
    model, tokenizer = loaded
    sdpa, _ = mhf.load_with_tokenizer(folder, attn_implementation="sdpa")
    rng = random.Random(options.seed)
    for t in range(2):
        trial = app.make_task("multikey", tokenizer, 200, (t + 0.5) / 2, rng, 4)
        context, question = app._ids(tokenizer, trial, True)
        assert question is not None and trial.prompt.endswith(trial.question)
        whole = torch.cat([context, question], 1)
        with torch.inference_mode():
            plain = sdpa.generate(input_ids=whole, max_new_tokens=10, do_sample=False)
            assert rows[1.0]["answers"][t] == tokenizer.decode(plain[0, whole.shape[1] :])
            with mhf.compress(model, kv.SnapKV(0.5)):
                cache = tf.DynamicCache()
                model(input_ids=context, past_key_values=cache, use_cache=True)
                out = model(input_ids=question, past_key_values=cache, use_cache=True)
                tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
                for _ in range(9):
                    out = model(input_ids=tokens[-1], past_key_values=cache, use_cache=True)
                    tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
        assert rows[0.5]["answers"][t] == tokenizer.decode(torch.cat(tokens, 1)[0])


def test_the_full_cache_row_times_the_full_cache_whatever_the_order_of_keeps(
    folder, tmp_path, monkeypatch
):
    """With keep 1.0 after a compressed keep (--keep 0.25,1.0) the full cache's rows took the
    ms per step of the last compressed cell decoded before them."""
    real = app._decode

    def timed(model, tokenizer, cache, first, new, policy, question=None):
        text, _ = real(model, tokenizer, cache, first, 2, policy, question)
        return text, 1.0 if policy is None else 2.0  # the full cache: 1 ms, compressed: 2

    monkeypatch.setattr(app, "_decode", timed)
    options = app.KvOptions(model=str(folder), lengths=(100,), keep=(0.5, 1.0),
                            policies=("snapkv", "tova"), trials=2,
                            out=tmp_path / "out")  # fmt: skip
    result = app.run(options)
    for row in result["rows"]:
        assert row["step_ms"] == (1.0 if row["keep"] == 1.0 else 2.0), row


@pytest.mark.parametrize(
    ("words", "want"),
    [
        (["niah_single"], ("niah_single",)),
        (["vt,cwe"], ("vt", "cwe")),
        (["vt", "cwe"], ("vt", "cwe")),
        (["all"], app.ruler.TASKS),
    ],
)
def test_tasks_on_the_command_line_are_names(words, want, tmp_path):
    """``--tasks niah_single`` reached the run as a tuple of one tuple (the parser gives one
    per word), and the suite stopped at its first task."""
    from multihead import _flags
    from multihead.cli import build_parser

    argv = ["kv", "--task", "ruler", "--tasks", *words]
    args = build_parser(argv).parse_args(argv)
    options = _flags.record_from(args.record, args)
    assert options.tasks == want


# a stand-in for kvpress in another interpreter: this one, with a "kvpress" package of a
# pipeline that answers the context's last 7-digit number (its full cache) or nothing (a
# press), and a KVzip press that cannot run
STUB_KVPRESS = """
import re
from dataclasses import dataclass
from transformers import AutoModelForCausalLM, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

@dataclass
class _Press:
    compression_ratio: float = 0.0
    press: object = None

class SnapKVPress(_Press): pass
class TOVAPress(_Press): pass
class StreamingLLMPress(_Press): pass
class ExpectedAttentionPress(_Press): pass
class KVzipPress(_Press): pass
class PyramidKVPress(_Press): pass
class ChunkKVPress(_Press): pass

class _Stub(Pipeline):
    def _sanitize_parameters(self, question=None, press=None, max_new_tokens=50,
                             answer_prefix=None, **kwargs):
        if question is not None:  # the answer starts after the turn, apart from the question
            assert answer_prefix and question.endswith("?")
        return {"question": question}, {"press": press}, {}
    def preprocess(self, context, question=None):
        return {"context": context, "question": question}
    def _forward(self, inputs, press=None):
        if isinstance(press, KVzipPress):
            raise RuntimeError("KVzip needs what this stand-in lacks")
        numbers = re.findall(r"[0-9]{7}", inputs["context"])
        return {"answer": "" if press is not None else numbers[-1]}
    def postprocess(self, outputs):
        return outputs

PIPELINE_REGISTRY.register_pipeline("kv-press-text-generation", pipeline_class=_Stub,
                                    pt_model=AutoModelForCausalLM)
"""


def _stub_python(tmp_path):
    import sys

    package = tmp_path / "stub" / "kvpress"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STUB_KVPRESS)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{package.parent}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return python


def test_kvpress_rows_come_from_its_interpreter_scored_as_ours(folder, loaded, tmp_path, capsys):
    """--kvpress-python: the same trials (context, question) go to the other interpreter as
    JSON, its answers come back and are scored as multihead's cells are; a press that cannot
    run there is named with its reason, the others still give their rows."""
    python = _stub_python(tmp_path)
    options = app.KvOptions(model=str(folder), task="multikey", lengths=(160,), keep=(1.0, 0.5),
                            policies=("snapkv",), trials=2, kvpress_python=python,
                            kvpress_presses=("snapkv", "kvzip"), out=tmp_path / "out")  # fmt: skip
    result = app.run(options)
    rows = {(r["policy"], r["keep"]): r for r in result["rows"]}
    assert set(rows) == {("snapkv", 1.0), ("snapkv", 0.5), ("kvpress:none", 1.0),
                         ("kvpress:snapkv", 0.5)}  # fmt: skip
    _, tokenizer = loaded
    rng = random.Random(options.seed)
    trials = [app.make_task("multikey", tokenizer, 160, (t + 0.5) / 2, rng, 4) for t in (0, 1)]
    import re

    want = [re.findall(r"[0-9]{7}", t.prompt[: len(t.prompt) - len(t.question)])[-1]
            for t in trials]  # fmt: skip
    assert rows[("kvpress:none", 1.0)]["answers"] == want
    assert rows[("kvpress:none", 1.0)]["correct"] == sum(
        t.answer == w for t, w in zip(trials, want)
    )
    assert rows[("kvpress:snapkv", 0.5)]["answers"] == ["", ""]
    assert rows[("kvpress:snapkv", 0.5)]["correct"] == 0
    assert "kvzip@0.5" in result["kvpress"]["errors"]
    printed = capsys.readouterr().out
    assert "kvpress's kvzip@0.5 did not run: RuntimeError: KVzip needs" in printed
    assert json.loads((tmp_path / "out" / "kv.json").read_text())["kvpress"]["errors"]


@pytest.mark.parametrize(
    ("question", "ask", "prefix"),
    [
        ("\nWhat is the pass key? The pass key is", "\nWhat is the pass key?", "The pass key is"),
        ("\nFind all. Answer: According to it, they are:", "\nFind all.",
         "Answer: According to it, they are:"),
        ("\nQuestion: Where? Answer: X works in", "\nQuestion: Where?", "Answer: X works in"),
    ],
)  # fmt: skip
def test_kvpress_gets_the_question_and_the_start_of_the_answer_apart(question, ask, prefix):
    assert app._asking(question) == {"question": ask, "answer_prefix": prefix}


def test_a_kvpress_interpreter_that_fails_is_named(folder, tmp_path):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'No module named kvpress' >&2\nexit 1\n")
    broken.chmod(0o755)
    options = app.KvOptions(model=str(folder), lengths=(100,), keep=(1.0, 0.5),
                            policies=("snapkv",), trials=1, kvpress_python=broken,
                            out=tmp_path / "out")  # fmt: skip
    with pytest.raises(ValueError, match=r"failed \(exit 1\): No module named kvpress"):
        app.run(options)
    missing = tmp_path / "nowhere" / "python"
    with pytest.raises(ValueError, match="--kvpress-python names no file"):
        app.run(app.KvOptions(model=str(folder), lengths=(100,), keep=(0.5,), trials=1,
                              kvpress_python=missing, out=tmp_path / "out2"))  # fmt: skip


def test_reconstruction_cells_read_the_prompt_twice_as_compress_context_does(folder, loaded,
                                                                             tmp_path):  # fmt: skip
    """--policies reconstruction: the cell's cache is compress_context's (the second reading
    after the repeat request), the question then runs on it under compress, as by hand."""
    options = app.KvOptions(model=str(folder), task="multikey", lengths=(160,), keep=(0.5,),
                            policies=("reconstruction",), trials=2, query_agnostic=True,
                            out=tmp_path / "out")  # fmt: skip
    result = app.run(options)
    (row,) = result["rows"]
    model, tokenizer = loaded
    rng = random.Random(options.seed)
    for t in range(2):
        trial = app.make_task("multikey", tokenizer, 160, (t + 0.5) / 2, rng, 4)
        context, question = app._ids(tokenizer, trial, True)
        with torch.inference_mode():
            policy = kv.Reconstruction(0.5)
            cache = mhf.compress_context(
                model, context, policy, repeat_ids=app._repeat_ids(tokenizer)
            )
            with mhf.compress(model, policy):
                out = model(input_ids=question, past_key_values=cache, use_cache=True)
                tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
                for _ in range(9):
                    out = model(input_ids=tokens[-1], past_key_values=cache, use_cache=True)
                    tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
        assert row["answers"][t] == tokenizer.decode(torch.cat(tokens, 1)[0])
    with pytest.raises(ValueError, match="--chunk with --policies reconstruction"):
        app.KvOptions(policies=("reconstruction",), chunk=64)

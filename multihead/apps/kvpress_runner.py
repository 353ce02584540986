"""The kvpress side of ``multihead kv --kvpress-python PATH``: run in that interpreter (an
environment of its own, since kvpress 0.5.5 pins transformers < 5.3), never imported by
multihead.

``python kvpress_runner.py REQUEST.json ANSWER.json``: REQUEST holds the model folder, the
presses, the shares kept and the trials (context, question, tokens to generate); each trial
runs through kvpress's own pipeline (``pipeline("kv-press-text-generation")``: the context
compressed by the press in the prefill, the question after it in the chat template's turn,
the answer started by the trial's ``answer_prefix``, greedy decoding), and ANSWER
gets every answer with its seconds, the versions, and the reason a press could not run. This
file imports only the standard library at the top: the interpreter running it need not have
multihead, and multihead's environment need not have kvpress.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

# kvpress's presses by the names multihead's table gives them, each at a compression ratio
# (the share removed): a ScorerPress, or a wrapper around SnapKV's
PRESSES = ("snapkv", "tova", "streaming", "expected_attention", "kvzip", "chunkkv", "pyramidkv")


def press(name: str, ratio: float):  # kvpress's classes, imported here
    import kvpress

    simple = {
        "snapkv": "SnapKVPress",
        "tova": "TOVAPress",
        "streaming": "StreamingLLMPress",
        "expected_attention": "ExpectedAttentionPress",
        "kvzip": "KVzipPress",
        "pyramidkv": "PyramidKVPress",
    }
    if name in simple:
        return getattr(kvpress, simple[name])(compression_ratio=ratio)
    if name == "chunkkv":
        return kvpress.ChunkKVPress(press=kvpress.SnapKVPress(compression_ratio=ratio))
    raise ValueError(f"unknown kvpress press {name!r}; the presses are {', '.join(PRESSES)}")


def main(request_path: str, answer_path: str) -> int:
    with open(request_path, encoding="utf-8") as f:
        request = json.load(f)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import kvpress  # noqa: F401  (registers the pipeline)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    torch.set_num_threads(int(request.get("threads") or torch.get_num_threads()))
    folder = request["model"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    rows, errors = [], {}
    cells = [("none", 1.0)] + [(p, k) for p in request["presses"] for k in request["keeps"]]
    for name, keep in cells:
        answers, seconds = [], []
        try:
            for trial in request["trials"]:
                chosen = None if name == "none" else press(name, 1.0 - keep)
                started = time.perf_counter()
                with torch.inference_mode():
                    out = pipe(trial["context"], question=trial["question"], press=chosen,
                               answer_prefix=trial.get("answer_prefix", ""),
                               max_new_tokens=int(trial["new_tokens"]))  # fmt: skip
                seconds.append(time.perf_counter() - started)
                answers.append(out["answer"])
        except Exception as err:  # a press that cannot run here is a row's reason, not a crash
            errors[f"{name}@{keep}"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            traceback.print_exc(file=sys.stderr)
            continue
        rows.append({"press": name, "keep": keep, "answers": answers, "seconds": seconds})
        print(f"kvpress {name} keep {keep}: {len(answers)} trials, {sum(seconds):.1f} s",
              flush=True)  # fmt: skip
    result = {
        "kvpress": _version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "rows": rows,
        "errors": errors,
    }
    with open(answer_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

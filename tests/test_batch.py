"""`numbat batch` on the real qwen2.5-coder:0.5b: both input forms, bad lines, exit status,
stdin, shards, resuming, and determinism (the same answers at any --parallel, in any order,
with the prefix cache on or off, and equal to `numbat prompt`'s), including after kill -9."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import cli
from models import catalog

pytestmark = pytest.mark.real
ROOT = Path(__file__).resolve().parent.parent
QWEN = "qwen2.5-coder:0.5b"
SYSTEM = ("You are a senior engineer who answers questions about programming and everyday facts. "
          "Keep every answer short: one or two sentences, or a few lines of code with no explanation. "
          "Never apologize, never repeat the question, and never add a closing remark. Prefer the standard "
          "library of the language asked about, name things plainly, and when a question is about a fact, "
          "give the fact first and the reason after it, in the fewest words that are still correct.")
QUESTIONS = ["Write a Python function that reverses a string.", "What is a hash table?",
             "Write a C function that returns the larger of two ints.", "Why is the sky blue?",
             "Write a JavaScript arrow function that squares a number.", "What does HTTP 404 mean?",
             "Write a SQL query that counts the rows of a table named users.", "Name three prime numbers.",
             "Write a Python list comprehension of the even numbers below 20.", "What is recursion?",
             "Write a bash command that counts the lines of a file.", "What is the boiling point of water?"]


def records(temperature=0.0):
    out = []
    for i, q in enumerate(QUESTIONS):
        if i % 2:
            out.append({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": QWEN, "messages": [{"role": "system", "content": SYSTEM},
                                                             {"role": "user", "content": q}],
                                 "max_tokens": 20, "temperature": temperature}})
        else:
            out.append({"id": f"q{i}", "messages": [{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": q}],
                        "max_tokens": 20, "temperature": temperature})
    return out


def write(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def invoke(*args, input=None):
    return CliRunner().invoke(cli.app, [str(a) for a in args], input=input, env={"COLUMNS": "160"},
                              catch_exceptions=False)


def answers(path: Path) -> dict:
    """id -> text (or error) of an output file; fails on a duplicated id."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        o = json.loads(line)
        if "custom_id" in o:
            key = o["custom_id"]
            val = o["response"]["body"]["choices"][0]["message"]["content"] if o["response"] else o["error"]["message"]
        else:
            key, val = o.get("id"), o.get("text", o.get("error"))
        key = key if key is not None and o.get("code") != "duplicate_id" else f"line {o.get('line')}"
        assert key not in out, f"{key} answered twice"
        out[key] = val
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The greedy answers at --parallel 1 without the prefix cache."""
    d = tmp_path_factory.mktemp("batch")
    r = invoke("batch", QWEN, write(d / "in.jsonl", records()), "-o", d / "out.jsonl", "--parallel", "1",
               "--no-prefix-cache")
    assert r.exit_code == 0, r.output
    got = answers(d / "out.jsonl")
    assert set(got) == {f"q{i}" for i in range(len(QUESTIONS))} and len(set(got.values())) == len(QUESTIONS)
    return got


@pytest.mark.parametrize("flags,shuffle", [(["--parallel", "8"], False), (["--parallel", "8"], True),
                                           (["--parallel", "3", "--no-prefix-cache"], True)])
def test_answers_do_not_depend_on_parallel_order_or_prefix_cache(reference, tmp_path, flags, shuffle):
    recs = records()
    if shuffle:
        random.Random(1).shuffle(recs)
    r = invoke("batch", QWEN, write(tmp_path / "in.jsonl", recs), "-o", tmp_path / "out.jsonl",
               "--metrics", tmp_path / "m.json", *flags)
    assert r.exit_code == 0, r.output
    assert answers(tmp_path / "out.jsonl") == reference
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["ok"] == len(QUESTIONS) and m["failed"] == 0 and m["completion_tokens"] > 0
    if "--no-prefix-cache" not in flags:   # the system prompt's pages are computed once
        assert m["cached_prompt_tokens"] >= 64 * (len(QUESTIONS) - 1) and m["prefix_cache_hit_rate"] > 0.5


def test_seeded_sampling_is_reproducible_alone_and_together(tmp_path):
    recs = records(temperature=0.9)
    outs = []
    for i, flags in enumerate((["--parallel", "1", "--no-prefix-cache"], ["--parallel", "6"])):
        r = invoke("batch", QWEN, write(tmp_path / f"in{i}.jsonl", recs[::-1] if i else recs), "-o",
                   tmp_path / f"out{i}.jsonl", "--seed", "7", *flags)
        assert r.exit_code == 0, r.output
        outs.append(answers(tmp_path / f"out{i}.jsonl"))
    assert outs[0] == outs[1]
    seeds = {json.loads(l)["seed"] for l in (tmp_path / "out0.jsonl").read_text().splitlines() if "seed" in json.loads(l)}
    assert len(seeds) == len(QUESTIONS) // 2     # the short-form records carry their derived seed


def test_a_record_answers_what_numbat_prompt_answers(reference):
    for i in (0, 3):
        r = invoke("prompt", QWEN, QUESTIONS[i], "--system", SYSTEM, "--temp", "0", "-n", "20", "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout.strip().splitlines()[-1])["text"] == reference[f"q{i}"]


def test_bad_lines_get_error_records_and_the_rest_completes(tmp_path):
    good = records()[:2]
    lines = [json.dumps(good[0]), "this is not json", json.dumps(good[1]), json.dumps(good[0]),
             json.dumps({"id": "t", "prompt": "hi", "temperature": "hot"}), json.dumps({"prompt": "no id"}),
             json.dumps({"id": "long", "prompt": "word " * 5000}),
             json.dumps({"custom_id": "m", "body": {"model": "llama3", "messages": [{"role": "user", "content": "hi"}]}}),
             json.dumps({"custom_id": "u", "url": "/v1/embeddings", "body": {"input": "x"}}),
             json.dumps({"id": "both", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
             json.dumps({"id": "raw", "prompt": "def add(a, b):", "raw": True, "max_tokens": 8, "temperature": 0})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    r = invoke("batch", QWEN, tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "-c", "2048")
    assert r.exit_code == 1
    assert "3 ok, 8 failed of 11 records" in r.stderr
    out = [json.loads(l) for l in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(out) == 11
    errs = {(o.get("line") or o["error"]["line"]): (o.get("error") if isinstance(o.get("error"), str) else o["error"]["message"])
            for o in out if o.get("error")}
    assert sorted(errs) == [2, 4, 5, 6, 7, 8, 9, 10]
    assert "not JSON" in errs[2] and "used before" in errs[4] and "temperature must be a number" in errs[5]
    assert "id is missing" in errs[6] and "context holds 2048" in errs[7] and "serves qwen2.5-coder:0.5b" in errs[8]
    assert "url must be" in errs[9] and "either prompt or messages" in errs[10]
    assert all(f"line {n}" in msg for n, msg in errs.items())
    raw = next(o for o in out if o.get("id") == "raw")
    assert raw["finish_reason"] == "length" and raw["usage"]["completion_tokens"] == 8


def test_stdin_and_shards(reference, tmp_path):
    data = "".join(json.dumps(r) + "\n" for r in records())
    r = invoke("batch", QWEN, "-", "-o", tmp_path / "all.jsonl", input=data)
    assert r.exit_code == 0, r.output
    assert answers(tmp_path / "all.jsonl") == reference
    parts = {}
    for i in (1, 2, 3):
        r = invoke("batch", QWEN, "-", "-o", tmp_path / f"s{i}.jsonl", "--shard", f"{i}/3", input=data)
        assert r.exit_code == 0, r.output
        got = answers(tmp_path / f"s{i}.jsonl")
        assert got and not set(got) & set(parts)
        parts.update(got)
    assert parts == reference


def test_rerun_resumes_repairs_a_torn_line_and_refuses_other_settings(reference, tmp_path):
    inp, out = write(tmp_path / "in.jsonl", records()), tmp_path / "out.jsonl"
    assert invoke("batch", QWEN, inp, "-o", out).exit_code == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:5]) + lines[5][:17])         # as a kill mid-write leaves it
    r = invoke("batch", QWEN, inp, "-o", out)
    assert r.exit_code == 0 and "torn last line" in r.stderr and "5 answered before" in r.stderr
    assert answers(out) == reference
    r = invoke("batch", QWEN, inp, "-o", out)                   # nothing left to do
    assert r.exit_code == 0 and f"{len(QUESTIONS)} answered before" in r.stderr and answers(out) == reference
    r = subprocess.run([sys.executable, "-m", "cli", "batch", QWEN, str(inp), "-o", str(out), "--temp", "0.5"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "--overwrite" in r.stderr
    assert invoke("batch", QWEN, inp, "-o", out, "--temp", "0.5", "--overwrite").exit_code == 0


def test_kill_9_at_random_moments_loses_nothing_and_duplicates_nothing(reference, tmp_path):
    inp, out = write(tmp_path / "in.jsonl", records()), tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "cli", "batch", QWEN, str(inp), "-o", str(out), "--parallel", "4"]
    rng, kills = random.Random(3), 0
    for target in (0, 2, 5, 9):         # kill once the output has this many lines, a random moment later
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while p.poll() is None and time.monotonic() < deadline and \
                (len(out.read_bytes().splitlines()) if out.exists() else 0) < target:
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 0.8))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert kills >= 3
    assert answers(out) == reference        # each id once, no torn line, the same texts


def test_ctrl_c_writes_nothing_torn_and_says_how_to_resume(reference, tmp_path):
    inp, out = write(tmp_path / "in.jsonl", records()), tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "cli", "batch", QWEN, str(inp), "-o", str(out), "--parallel", "2"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))   # as a terminal has it
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (len(out.read_bytes().splitlines()) if out.exists() else 0) < 2:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 130 and "run the same command again to resume" in err and "Traceback" not in err
    done = answers(out)                     # every line whole
    assert 2 <= len(done) < len(QUESTIONS) and all(reference[k] == v for k, v in done.items())
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and answers(out) == reference


def test_each_record_its_own_constraint(tmp_path):
    import jsonschema
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 130}},
              "required": ["name", "age"], "additionalProperties": False}
    color = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}
    ask = lambda q: [{"role": "user", "content": q}]
    lines = [
        {"custom_id": "p", "body": {"messages": ask("Invent a person; reply in JSON."), "max_tokens": 60, "temperature": 0,
                                    "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": person}}}},
        {"custom_id": "o", "body": {"messages": ask("Reply with a JSON object about cats."), "max_tokens": 60,
                                    "temperature": 0, "response_format": {"type": "json_object"}}},
        {"id": "c", "messages": ask("Pick a color. Reply in JSON."), "schema": color, "max_tokens": 30, "temperature": 0},
        {"id": "g", "prompt": "Say yes or no.", "grammar": 'root ::= "yes" | "no"', "max_tokens": 5, "temperature": 0},
        {"id": "bad", "prompt": "x", "schema": {"type": "object", "uniqueItems": True, "not": {}}},
    ]
    r = invoke("batch", QWEN, write(tmp_path / "in.jsonl", lines), "-o", tmp_path / "out.jsonl", "--parallel", "4")
    assert r.exit_code == 1 and "4 ok, 1 failed" in r.stderr
    got = answers(tmp_path / "out.jsonl")
    jsonschema.validate(json.loads(got["p"]), person)
    assert isinstance(json.loads(got["o"]), dict)
    jsonschema.validate(json.loads(got["c"]), color)
    assert got["g"] in ("yes", "no")
    assert got["bad"].startswith("line 5: schema:") and "cannot enforce" in got["bad"]

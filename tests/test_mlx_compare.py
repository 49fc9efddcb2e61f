"""bench/mlx_compare.py without a Mac, mlx-lm or llama-bench: its arguments, the command lines
it builds, the parsing of each engine's output, the ratios and table, and the skip lines.
No model runs: the engines are replaced by synthetic rates."""
import importlib.util
import json
import platform

import pytest
from gguf import GGMLQuantizationType as T

from bench import mlx_compare as mc
from gguf_io.testing import write_tiny_model


def args(*argv):
    return mc.parse_args(["qwen2.5-coder:0.5b", *argv])


def test_defaults_and_bad_arguments():
    a = args()
    assert (a.p, a.n, a.reps, a.rounds, a.threads, a.json) == (512, 128, 3, 2, None, False)
    assert a.engines == list(mc.ENGINES)
    assert args("--engines", "mlx-lm, llama.cpp").engines == ["mlx-lm", "llama.cpp"]
    for bad in (["--engines", "ollama"], ["-n", "1"], ["-a", "0"], ["--mlx-bits", "7"]):
        with pytest.raises(SystemExit) as e:
            args(*bad)
        assert e.value.code == 2, bad


def test_command_lines():
    a = args("-p", "256", "-n", "64", "-r", "5")
    nb = mc.numbat_cmd(a)
    assert nb[1:] == ["-m", "cli", "bench", "qwen2.5-coder:0.5b", "-p", "256", "-n", "64", "-r", "5",
                      "--json", "--backend", "mlx"]
    assert mc.numbat_cmd(args("-t", "4"))[-2:] == ["-t", "4"]
    assert mc.llama_cmd("/x/llama-bench", "/m.gguf", a) == ["/x/llama-bench", "-m", "/m.gguf", "-p", "256", "-n", "64",
                                                          "-r", "5", "-o", "json"]
    # mlx_lm/benchmark.py: -p/--prompt-tokens, -g/--generation-tokens, -n/--num-trials
    assert mc.mlx_lm_cmd("dir", a, True)[1:] == ["-m", "mlx_lm.benchmark", "--model", "dir", "-p", "256", "-g", "64",
                                                 "-n", "5"]
    gen = mc.mlx_lm_cmd("dir", a, False)
    assert gen[1:3] == ["-m", "mlx_lm.generate"] and gen[gen.index("--max-tokens") + 1] == "64"
    assert len(gen[gen.index("--prompt") + 1].split()) == 256 and "--ignore-chat-template" in gen
    assert mc.convert_cmd("Qwen/X", "out", 4)[1:] == ["-m", "mlx_lm.convert", "--hf-path", "Qwen/X", "--mlx-path", "out",
                                                      "-q", "--q-bits", "4", "--q-group-size", "64"]
    assert "-q" not in mc.convert_cmd("Qwen/X", "out", None)


def test_hf_repos_cover_the_catalog():
    from models import catalog
    assert set(mc.HF_REPOS) == set(catalog.CATALOG)


@pytest.mark.parametrize("wtype, bpw, bits", [(T.Q8_0, 8.5, 8), (T.Q4_0, 4.5, 4), (T.F16, 16.0, None)])
def test_bits_from_the_gguf(tmp_path, wtype, bpw, bits):
    path = write_tiny_model(tmp_path / "m.gguf", weight_type=wtype)
    assert mc.gguf_bits(path) == pytest.approx(bpw)
    assert mc.mlx_bits(mc.gguf_bits(path)) == bits


def test_nearest_width():
    # the catalog's Q4_K_M files average 5.00 (1.5b), 6.16 (0.5b), 7.35 (gemma3) bits/weight
    assert [mc.mlx_bits(b) for b in (2.6, 3.4, 4.9, 5.2, 6.16, 7.35, 8.6)] == [2, 3, 4, 5, 6, 6, 8]


def test_parse_mlx_benchmark():
    out = ("Running warmup..\nTiming with prompt_tokens=512, generation_tokens=128, batch_size=1.\n"
           "Trial 1:  prompt_tps=1000.000, generation_tps=100.000, peak_memory=0.500, total_time=2.000\n"
           "Trial 2:  prompt_tps=2000.000, generation_tps=140.000, peak_memory=0.500\n"
           "Averages: prompt_tps=9999.000, generation_tps=9999.000, peak_memory=0.500\n")
    got = mc.parse_mlx_benchmark(out, args())
    assert got == {"pp512": pytest.approx(1500), "tg128": pytest.approx(120 * 127 / 128)}   # not the Averages line
    with pytest.raises(mc.EngineError):
        mc.parse_mlx_benchmark("Averages: prompt_tps=1.0, generation_tps=1.0", args())


def test_parse_mlx_generate():
    out = "some text\n==========\nPrompt: 515 tokens, 800.500 tokens-per-sec\nGeneration: 128 tokens, " \
          "64.000 tokens-per-sec\nPeak memory: 0.4 GB\n"
    assert mc.parse_mlx_generate(out) == (515, 800.5, 128, pytest.approx(63.5))
    with pytest.raises(mc.EngineError):
        mc.parse_mlx_generate("No text generated for this prompt")


def test_parse_llama_and_numbat():
    ll = [{"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 900.5}, {"n_prompt": 0, "n_gen": 128, "avg_ts": 80.25}]
    assert mc.parse_llama(json.dumps(ll)) == {"pp512": 900.5, "tg128": 80.25}
    row = {"model": "m", "backend": "mlx", "test": "pp512", "n_depth": 0, "tokens_per_s": 321.0, "stddev": 1.0}
    out = "compiling...\n" + json.dumps(row) + "\n" + json.dumps({**row, "test": "tg128", "tokens_per_s": 45.5})
    assert mc.parse_numbat(out, args()) == {"pp512": 321.0, "tg128": 45.5}
    with pytest.raises(mc.EngineError, match="numba"):         # numbat ignored --backend mlx
        mc.parse_numbat(json.dumps({**row, "backend": "numba"}), args())


def test_ratios_and_table():
    med = mc.medians({"numbat-mlx": {"pp512": [100, 300, 200], "tg128": [50]},
                      "mlx-lm": {"pp512": [400, 400], "tg128": [40, 40]}})
    assert med["numbat-mlx"]["pp512"] == 200
    rows = mc.table_rows(med, ["pp512", "tg128"])
    assert rows[0] == {"test": "pp512", "numbat-mlx": 200, "mlx-lm": 400, "llama.cpp": None,
                       "numbat-mlx/mlx-lm": 0.5, "numbat-mlx/llama.cpp": None}
    assert rows[1]["numbat-mlx/mlx-lm"] == 1.25
    md = mc.markdown(rows).splitlines()
    assert md[0].count("|") == md[1].count("|") == md[2].count("|") == 7
    assert md[2] == "| pp512 | 200.00 | 400.00 | - | 0.50 | - |"
    assert md[3] == "| tg128 | 50.00 | 40.00 | - | 1.25 | - |"


def test_missing_mlx_lm_and_llama_bench_is_one_line_each(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("mlx_lm") else real(name, *a))
    with pytest.raises(SystemExit) as e:          # exits before any model is fetched or run
        mc.main(["gemma3:270m", "--engines", "mlx-lm,llama.cpp", "--llama-bin", str(tmp_path)])
    assert "nothing to run" in str(e.value.code)
    err = capsys.readouterr().err.splitlines()
    assert "mlx-lm: skipped: mlx-lm is not installed (pip install mlx-lm)" in err
    assert f"llama.cpp: skipped: no llama-bench in {tmp_path} (brew install llama.cpp, or --llama-bin DIR)" in err
    assert (platform.system() == "Darwin") != any("correctness vehicle only" in ln for ln in err)
    assert mc.missing("mlx-lm", mc.parse_args(["x.gguf", "--mlx-model", "d"])) is not None   # still not installed


def test_rounds_alternate_and_a_failing_engine_is_dropped(monkeypatch, tmp_path, capsys):
    gguf = write_tiny_model(tmp_path / "m.gguf")
    monkeypatch.setattr(mc, "missing", lambda e, a: None)
    calls = []

    def fake(engine, a, ctx, notes):                  # synthetic rates: no model runs
        calls.append(engine)
        if engine == "llama.cpp" and len(calls) > 3:
            raise mc.EngineError("llama-bench was killed by SIGSEGV")
        base = {"numbat-mlx": 100.0, "mlx-lm": 200.0, "llama.cpp": 50.0}[engine] * len(calls)
        return {"pp16": base, "tg8": base / 10}

    monkeypatch.setattr(mc, "run_engine", fake)
    mc.main([str(gguf), "-p", "16", "-n", "8", "-a", "3", "--mlx-model", "some/dir", "--json"])
    # the first engine rotates from round to round; llama.cpp fails in round 2 and stays out
    assert calls == ["numbat-mlx", "mlx-lm", "llama.cpp", "mlx-lm", "llama.cpp", "numbat-mlx", "numbat-mlx", "mlx-lm"]
    out = json.loads(capsys.readouterr().out)
    assert out["skipped"] == {"llama.cpp": "llama-bench was killed by SIGSEGV"}
    assert "mlx-lm model: some/dir (given by --mlx-model)" in out["notes"]
    pp = out["rows"][0]
    # numbat-mlx at calls 1, 6, 7 -> median 600; mlx-lm at 2, 4, 8 -> 800; llama.cpp round 1 only
    assert (pp["test"], pp["numbat-mlx"], pp["mlx-lm"], pp["llama.cpp"]) == ("pp16", 600, 800, 150)
    assert pp["numbat-mlx/mlx-lm"] == 0.75 and pp["numbat-mlx/llama.cpp"] == 4.0
    assert platform.machine() in out["title"]

"""User errors on the command line and in the engine's arguments: one `error:` line and exit status 2
(a ValueError / TypeError from the Python API), found before the model loads wherever possible."""

from __future__ import annotations

import json

import pytest
import torch

from pageflash import LLM
from pageflash.cli import main as cli_main
from pageflash.engine.engine import EngineConfig
from pageflash.model.loader import iter_hf_weights
from pageflash.server.app import main as serve_main
from pageflash.spec.train_medusa import main as train_main


def run(capsys, argv) -> tuple[int, str]:
    rc = cli_main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_generate_file_errors(tmp_path, capsys):
    rc, err = run(capsys, ["generate", "--input", str(tmp_path / "missing.jsonl")])
    assert rc == 2 and "missing.jsonl" in err
    rc, err = run(capsys, ["generate", "--input", str(tmp_path)])
    assert rc == 2 and "directory" in err.lower()
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "hi"}) + "\n")
    rc, err = run(capsys, ["generate", "--input", str(rows), "--output", str(tmp_path / "no" / "out.jsonl")])
    assert rc == 2 and "--output" in err
    for bad, what in (("5", "row 1 must be a JSON object"), (json.dumps({"messages": "oops"}), "'messages' must be")):
        rows.write_text(bad + "\n")
        rc, err = run(capsys, ["generate", "--input", str(rows)])
        assert rc == 2 and what in err


def test_engine_argument_errors(tmp_path, capsys):
    rc, err = run(capsys, ["generate", "hi", "--device", "cuda:abc"])
    assert rc == 2 and "cuda:N" in err
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("[1, 2]")
    rc, err = run(capsys, ["generate", "hi", "--model", str(folder)])
    assert rc == 2 and "JSON object" in err
    for kw, name in ((dict(enforce_eager="no"), "enforce_eager"), (dict(enable_prefix_caching=1), "enable_prefix_caching"),
                     (dict(async_scheduling="false"), "async_scheduling"),
                     (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization")):
        with pytest.raises((TypeError, ValueError), match=name):
            EngineConfig(**kw)
    assert EngineConfig(dtype=torch.float16).dtype == "float16"  # torch dtypes are taken, as vLLM does
    for bad in (["x"], torch.int8):
        with pytest.raises(ValueError, match="dtype"):
            EngineConfig(dtype=bad)


def test_corrupt_bin_weights(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a checkpoint" * 10)
    with pytest.raises(ValueError, match="corrupt or unreadable"):
        list(iter_hf_weights(str(tmp_path)))


def test_kv_cache_too_large_is_a_value_error():
    with pytest.raises(ValueError, match="does not fit"):
        LLM("smollm2-135m", load_format="dummy", num_kv_blocks=10**9, max_model_len=64, dtype="float32")
    assert torch.zeros(1).sum() == 0  # the process is fine afterwards


def test_serve_and_train_medusa_flag_errors(capsys):
    with pytest.raises(SystemExit) as e:
        serve_main(["--port", "99999999", "--load-format", "dummy"])
    assert e.value.code == 2 and "--port" in capsys.readouterr().err
    assert serve_main(["--model", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err
    for argv, flag in ((["--num-heads", "0"], "--num-heads"), (["--batch-size", "0"], "--batch-size"),
                       (["--epochs", "-1"], "--epochs"), (["--output", "/no/such/dir/h.safetensors"], "--output")):
        with pytest.raises(SystemExit) as e:
            train_main(argv)
        assert e.value.code == 2 and flag in capsys.readouterr().err


def test_medusa_path_not_safetensors(tmp_path):
    from pageflash.spec.medusa import load_heads

    f = tmp_path / "heads.gguf"
    f.write_text("not safetensors")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_heads(str(f))


def test_speculative_config_errors_name_the_draft():
    from pageflash.spec.config import SpeculativeConfig

    with pytest.raises(ValueError, match="the draft model: unknown model 'nosuch'"):
        SpeculativeConfig.parse({"method": "draft_model", "model": "nosuch", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match=r"the tree \[8, 8, 8\] gives 584"):
        SpeculativeConfig.parse({"method": "early_exit", "num_layers": 2, "tree": [8, 8, 8]})


def test_cli_refusals_name_the_problem(tmp_path, capsys, monkeypatch):
    """Triton attention without CUDA, a chat template that refuses the messages, a tokenizer that
    does not exist: one error line, exit 2. `bench --help` is help, not an error."""
    from hf_ref import make_random_hf_folder

    folder = make_random_hf_folder(tmp_path / "m", dict(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"],
        num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rc, err = run(capsys, ["generate", "hi", "--model", folder, "--device", "cpu", "--attention-backend", "triton"])
    assert rc == 2 and "needs a CUDA device" in err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc, err = run(capsys, ["generate", "hi", "--model", folder, "--tokenizer", str(tmp_path / "nothing")])
    assert rc == 2 and err.startswith("error: tokenizer: unknown model")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    rc, err = run(capsys, ["generate", "--input", str(rows), "--max-model-len", "256"])
    assert rc == 2 and "chat template refused the messages" in err
    assert cli_main(["bench", "--help"]) == 0 and "pageflash bench" in capsys.readouterr().out
    assert cli_main(["bench"]) == 2 and "a benchmark kind is needed" in capsys.readouterr().err
    assert cli_main(["bench", "bogus"]) == 2 and "invalid choice 'bogus'" in capsys.readouterr().err


def test_serve_refuses_a_taken_port_and_two_models(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert serve_main(["--port", str(port), "--load-format", "dummy"]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        serve_main(["smollm2-135m", "--model", "llama-3-8b"])
    assert e.value.code == 2 and "given twice" in capsys.readouterr().err


def test_streamed_text_never_shows_what_a_stop_string_cuts(capsys):
    """`generate` prints text as it grows but holds back what could be the start of a stop string."""
    import io

    from pageflash.cli import _stream
    from pageflash.sampling_params import SamplingParams

    llm = LLM(max_model_len=128, num_kv_blocks=32)
    eng = llm.llm_engine
    base = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    text = base[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    out = io.StringIO()
    final = _stream(eng, "The capital of France is", SamplingParams(temperature=0, max_tokens=12, stop=[stop]), out)
    assert final == text[: text.find(stop)] and out.getvalue() == final + "\n"


def test_generate_prints_every_sample_of_n(capsys):
    """-n 3: the first sample streams, the others follow; each under its own header. `chat` keeps one
    reply per turn, so it refuses -n > 1."""
    import io

    from pageflash.cli import _stream
    from pageflash.sampling_params import SamplingParams

    llm = LLM(max_model_len=128, num_kv_blocks=32)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=6, n=3)
    ref = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs
    out = io.StringIO()
    final = _stream(llm.llm_engine, "Once upon a time", params, out)
    assert final == ref[0].text
    assert out.getvalue() == "".join(f"--- sample {i + 1} of 3 ---\n{c.text}\n" for i, c in enumerate(ref))
    rc, err = run(capsys, ["chat", "-n", "2"])
    assert rc == 2 and "-n must be 1" in err


def test_generate_with_structured_outputs_and_bad_words(tmp_path, capfd):
    """--json-schema (a file or JSON text), --choice (repeatable), --bad-word; a bad constraint is one
    error line and status 2."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                  "required": ["city"], "additionalProperties": False}))
    common = ["--max-model-len", "128", "--num-kv-blocks", "32", "--temperature", "0", "--max-tokens", "24", "--chat"]
    assert cli_main(["generate", *common, "--json-schema", str(schema), "The capital of France, as JSON"]) == 0
    out = capfd.readouterr().out
    assert set(json.loads(out)) == {"city"}
    assert cli_main(["generate", *common, "--choice", "yes", "--choice", "no", "Is the sky blue?"]) == 0
    assert capfd.readouterr().out.strip() in ("yes", "no")
    assert cli_main(["generate", *common, "--bad-word", "Paris", "The capital of France is"]) == 0
    assert "Paris" not in capfd.readouterr().out
    rc, err = run(capfd, ["generate", *common, "--regex", "[a-", "x"])
    assert rc == 2 and "regex" in err
    rc, err = run(capfd, ["generate", *common, "--json-schema", "{oops", "x"])
    assert rc == 2 and "--json-schema" in err


def test_ctrl_c_before_a_command_handles_it_is_one_line_and_status_130(monkeypatch, capsys):
    """Ctrl-C while the model loads (before generate / chat / serve handle it themselves): status 130
    and one line on stderr, not a KeyboardInterrupt traceback."""
    import pageflash.cli as cli
    import pageflash.server.app as app

    def interrupted(*_a, **_kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_generate", interrupted)
    monkeypatch.setattr(app, "main", interrupted)
    for argv in (["generate", "hi"], ["serve"]):
        assert cli.main(argv) == 130
        err = capsys.readouterr().err
        assert err == "pageflash: interrupted\n"


def test_tensor_parallel_help_does_not_refuse_speculation(capsys):
    """-tp's help once said "no speculative decoding", which the engine runs over the ranks (README,
    tests/test_tensor_parallel.py); the help names the CPU's gloo processes too."""
    for cmd in ("generate", "chat"):
        with pytest.raises(SystemExit):
            cli_main([cmd, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "no speculative decoding" not in out
        assert "speculative decoding works over the ranks" in out and "gloo" in out


def test_generate_reads_standard_input(tmp_path, capfd, monkeypatch):
    """'-' as the prompt reads it from standard input (whole, one trailing newline dropped) and streams
    what the same prompt on the command line streams; '--input -' reads JSONL rows from it; an empty
    prompt there is one error line and status 2."""
    import io

    common = ["--max-model-len", "128", "--num-kv-blocks", "32", "--temperature", "0", "--max-tokens", "6"]
    assert cli_main(["generate", *common, "The capital of France is"]) == 0
    want = capfd.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("The capital of France is\n"))
    assert cli_main(["generate", *common, "-"]) == 0
    assert capfd.readouterr().out == want
    rows = "\n".join(json.dumps(r) for r in ({"prompt": "The capital of France is", "id": "a"},
                                             {"prompt_token_ids": [1, 2, 3]}))
    monkeypatch.setattr("sys.stdin", io.StringIO(rows + "\n"))
    out = tmp_path / "out.jsonl"
    assert cli_main(["generate", *common, "--input", "-", "--output", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("id") for r in recs] == ["a", None]
    assert recs[0]["outputs"][0]["text"] == want.rstrip("\n")
    for text in ("", "\n", "  \n"):
        monkeypatch.setattr("sys.stdin", io.StringIO(text))
        rc, err = run(capfd, ["generate", *common, "-"])
        assert rc == 2 and "standard input is empty" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("[1, 2]\n"))
    rc, err = run(capfd, ["generate", *common, "--input", "-"])
    assert rc == 2 and "<stdin>: row 1 must be a JSON object" in err

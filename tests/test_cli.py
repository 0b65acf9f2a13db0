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

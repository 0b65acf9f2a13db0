"""DecodeGraphs.run's inputs on the CPU (the graphs mocked: each "replay" runs the captured step's
function over the static buffers, the Triton kernels under the interpreter): the block tables are
copied only up to the widest row filled so far (DecodeGraphs.bt_cols), and the buffer a replay reads
is exactly what a full-width copy leaves, step after step, as batches grow, shrink and regrow."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_ref import hf_greedy, make_random_hf_folder
from pageflash import LLM, SamplingParams
from test_engine_hf import CONFIGS

NEW = 10


def mock_decode_graphs(monkeypatch):
    """Decode graphs on the CPU: a capture runs the step once and keeps its function, which each replay
    runs again over the static buffers (its outputs copied into the captured ones); no prefetcher,
    precompile or device sync. Returns pageflash.engine.model_runner (also tests/test_lora.py's)."""
    import pageflash.engine.model_runner as mr

    class Replay:
        def __init__(self, fwd, out):
            self.fwd, self.out = fwd, out

        def replay(self):
            for o, n in zip(self.out, self.fwd()):
                if o is not None:
                    o.copy_(n)

    def capture(runner, fwd):
        out = fwd()
        return Replay(fwd, out), out

    monkeypatch.setattr(mr, "_capture_graph", capture)
    monkeypatch.setattr(mr, "_prefetcher_from_env", lambda device: None)
    monkeypatch.setattr(mr, "_precompile_from_env", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return mr


@pytest.mark.parametrize("mode", ["used", "full"])
def test_block_tables_copied_up_to_the_widest_row_equal_a_full_copy(tmp_path, monkeypatch, mode):
    mr = mock_decode_graphs(monkeypatch)
    monkeypatch.setenv("PAGEFLASH_DECODE_BT_COPY", mode)
    folder = make_random_hf_folder(tmp_path, CONFIGS["llama-gqa"])
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    llm = LLM(folder, dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=96, attention_backend="triton",
              enforce_eager=True)
    r = llm.llm_engine.runner
    r.graphs = g = mr.DecodeGraphs(r, 4)  # buckets 1, 2, 4; 16 block-table columns
    g.capture()
    shadow = g.block_tables.clone()  # what a full-width copy of every step would leave
    widths = []
    run = g.run

    def checked(sched, block_tables, prev_tokens=None):
        bucket = next(x for x in g.buckets if x >= len(sched.seqs))
        shadow[:bucket] = 0
        for i, t in enumerate(block_tables):
            shadow[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        out = run(sched, block_tables, prev_tokens)
        assert torch.equal(g.block_tables, shadow)
        widths.append(g.bt_cols(block_tables))
        return out

    monkeypatch.setattr(g, "run", checked)
    gen = torch.Generator().manual_seed(3)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for lengths in ((3, 9, 13), (2,), (30, 5), (1, 4, 7, 11)):  # grow, shrink, widest, regrow
        prompts = [torch.randint(0, 211, (n,), generator=gen).tolist() for n in lengths]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, NEW) for p in prompts]
    assert len(widths) >= 4 * (NEW - 2)  # the decode steps went through the graphs
    if mode == "full":
        assert set(widths) == {g.max_blocks}
    else:  # narrower than the buffer, growing with the widest table seen: 6 blocks, then 10 (30 + 10 tokens)
        assert widths == sorted(widths) and widths[0] < widths[-1] == 10 < g.max_blocks
    assert llm.llm_engine.kv.num_free_blocks == 96


def test_bt_copy_mode_names_a_bad_value(monkeypatch, tmp_path):
    mr = mock_decode_graphs(monkeypatch)
    monkeypatch.setenv("PAGEFLASH_DECODE_BT_COPY", "some")
    folder = make_random_hf_folder(tmp_path, CONFIGS["llama-gqa"])
    llm = LLM(folder, dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=32, enforce_eager=True)
    with pytest.raises(ValueError, match="PAGEFLASH_DECODE_BT_COPY must be 'used' or 'full', got 'some'"):
        mr.DecodeGraphs(llm.llm_engine.runner, 4)


def test_staged_inputs_cycle_and_longrope_rows_reach_the_graphs(tmp_path, monkeypatch):
    """The host images a step fills (HostStage: persistent sets taken in turn, no allocation per step)
    carry every input the graphs read, LongRoPE's rotary rows included: a prompt of 17 tokens switches
    to the long factors at position 32 while decoding (in the graphs), one of 33 decodes with them
    throughout, in the same batch; greedy tokens equal HF's, and the sets were cycled."""
    mr = mock_decode_graphs(monkeypatch)
    folder = make_random_hf_folder(tmp_path, CONFIGS["phi3-longrope"])
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    llm = LLM(folder, dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=96, attention_backend="triton",
              enforce_eager=True)
    r = llm.llm_engine.runner
    r.graphs = g = mr.DecodeGraphs(r, 4)
    assert g.rope_rows is not None
    g.capture()
    taken = []
    take = g._stage.take

    def counted():
        out = take()
        taken.append(g._stage.i)
        return out

    monkeypatch.setattr(g._stage, "take", counted)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 211, (n,), generator=gen).tolist() for n in (17, 33)]
    new = 20  # the first crosses position 32 at its 16th token
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, new) for p in prompts]
    assert len(taken) >= new - 2 and set(taken) == set(range(len(g._stage.sets)))
    assert llm.llm_engine.kv.num_free_blocks == 96

"""`specserve train-draft` end to end on a tiny random model (CPU, about a minute): data from the
target's own generations, a head with its config and log, α by position printed; a run stopped
by --minutes and a finished one both resume; a new run fine-tunes a trained head (--init-from); a
head or run directory for another target is refused; the trained head drafts losslessly through
the engine."""
from __future__ import annotations

import json

import pytest
import torch

from cluster.cli import main
from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.request import GenerationRequest, SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from cluster.models.device import resolve_device
from cluster.models.load import load_model
from cluster.speculative.eagle_head import CONFIG_FILE, WEIGHTS_FILE, EagleTargetMismatch, load_head
from cluster.training.eagle_trainer import CHECKPOINT, LOG, SAMPLES
from tests.conftest import make_tiny_model_dir
from tests.engine.helpers import run_to_completion

# A run whose claim is not about the size of its data generates a few samples (a generation batch
# is admitted whole, so a small --tokens alone would still generate 16); a refusal of the head
# --init-from names comes after the data stage
SMALL = ["--tokens", "400", "--gen-batch-size", "4"]
ARGS = ["--tokens", "2500", "--draft-vocab", "512", "--max-new-tokens", "16", "--max-prompts", "60",
        "--row-tokens", "256", "--ttt-steps", "3", "--threads", "2"]


def train(model_dir, out, *extra) -> int:
    return main(["train-draft", "--model", str(model_dir), "--out", str(out), *ARGS, *extra])


def plain_and_eagle(model_dir, head_dir, prompts: list[list[int]]) -> tuple[dict, dict]:
    """The engine's results for ``prompts`` decoded plainly, then drafted by the head in
    ``head_dir`` (K = 3), greedy, 24 tokens each."""
    target = load_model(str(model_dir), EngineConfig(model=str(model_dir)))

    def run(spec):
        config = EngineConfig(model="tiny", spec=spec)
        m = target.with_fresh_kv(config)
        eng = LLMEngine(config, m, build_spec_controller(config, m) if spec else None)
        reqs = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=24)) for i, p in enumerate(prompts)]
        return run_to_completion(eng, reqs)

    return run(None), run(SpecConfig(drafter=f"eagle:{head_dir}", num_draft_tokens=3))


def test_train_draft_end_to_end(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "head"
    # --minutes already spent: nothing generated yet, and a clear note to run again
    assert train(tiny_llama_dir, out, "--epochs", "1", "--minutes", "0.000001") == 0
    assert "stopped by --minutes" in capsys.readouterr().err
    assert not (out / CONFIG_FILE).exists()

    assert train(tiny_llama_dir, out, "--epochs", "1") == 0
    cap = capsys.readouterr()
    assert "held-out α by draft position" in cap.out and "finished after" in cap.out
    assert f"on {resolve_device('auto')}, " in cap.err  # --device auto: a GPU where torch sees one
    cfg = json.loads((out / CONFIG_FILE).read_text())
    assert cfg["target"]["model_type"] == "llama" and len(cfg["feature_layers"]) == 3
    assert cfg["draft_vocab_size"] == 512 and cfg["training"]["finished"]
    steps1 = cfg["training"]["step"]
    assert steps1 > 0 and (out / WEIGHTS_FILE).is_file() and (out / CHECKPOINT).is_file()
    samples = [json.loads(l) for l in (out / SAMPLES).read_text().splitlines()]
    assert any(s["index"] % 20 == 0 for s in samples) and any(s["index"] % 20 for s in samples)
    log = [json.loads(l) for l in (out / LOG).read_text().splitlines()]
    alphas = log[-1]["alpha_by_position"]
    assert log[-1]["event"] == "eval" and len(alphas) == 3 and log[-1]["anchors"] > 0
    # by corpus source too: the held-out anchors split among the sources, each line printed
    by_source = log[-1]["by_source"]
    assert by_source and set(by_source) <= {"chat", "docs", "json", "multilingual"}
    assert sum(v["anchors"] for v in by_source.values()) == log[-1]["anchors"]
    for source, v in by_source.items():
        assert len(v["alpha_by_position"]) == 3 and f"  {source}: [" in cap.out, source
    # and at the steps a greedy engine drafting 3 tokens would take (fewer than the anchors)
    assert 0 < log[-1]["steps_counted"] < log[-1]["anchors"] and len(log[-1]["step_alpha_by_position"]) == 3
    assert sum(v["steps_counted"] for v in by_source.values()) == log[-1]["steps_counted"]
    assert "at the steps of a greedy engine drafting 3 tokens" in cap.out
    print(f"tiny model, α by position after {steps1} steps: {alphas}")

    # resume: a finished run trains one more epoch from its checkpoint (head + optimizer + step);
    # another generation batch is not another recipe (the samples do not depend on it)
    assert train(tiny_llama_dir, out, "--epochs", "2", "--gen-batch-size", "5") == 0
    cap = capsys.readouterr()
    assert f"resumed at step {steps1}" in cap.err
    step2 = json.loads((out / CONFIG_FILE).read_text())["training"]["step"]
    assert step2 >= steps1 + steps1 // 2  # counted on from the checkpoint (epoch 2 packs rows anew)
    # the recipe must match to resume
    assert main(["train-draft", "--model", str(tiny_llama_dir), "--out", str(out),
                 *[a if a != "512" else "256" for a in ARGS]]) == 2
    assert "another recipe" in capsys.readouterr().err

    # fine-tuning: a new run starts from the trained head (its weights and draft vocabulary)
    tuned = tmp_path / "tuned"
    assert train(tiny_llama_dir, tuned, "--epochs", "1", "--seed", "1", "--init-from", str(out), *SMALL) == 0
    assert f"starting from the head in {out}" in capsys.readouterr().err
    assert torch.equal(load_head(tuned).draft_to_target, load_head(out).draft_to_target)
    assert json.loads((tuned / CONFIG_FILE).read_text())["training"]["init_from"] == str(out)
    assert main(["train-draft", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "t2"),
                 *[a if a != "512" else "1024" for a in ARGS], "--init-from", str(out), *SMALL]) == 2
    assert "has a draft vocabulary of 512 tokens, fewer than --draft-vocab 1024" in capsys.readouterr().err
    # a smaller --draft-vocab trims the head to its most frequent tokens in the run's outputs;
    # --epochs 0 trains nothing: the kept rows of its LM head and every other weight are the head's
    # (its data are the first run's: the same prompts and seed generate the same samples, so the
    # run reads them instead of generating them again)
    trimmed = tmp_path / "trimmed"
    (trimmed / SAMPLES).parent.mkdir(parents=True)
    (trimmed / SAMPLES).write_bytes((out / SAMPLES).read_bytes())
    assert main(["train-draft", "--model", str(tiny_llama_dir), "--out", str(trimmed),
                 *[a if a != "512" else "128" for a in ARGS], "--epochs", "0", "--init-from", str(out)]) == 0
    cap = capsys.readouterr()
    assert "trimmed to the 128 most frequent" in cap.err and "held-out α by draft position" in cap.out
    small, big = load_head(trimmed), load_head(out)
    assert small.cfg.draft_vocab_size == 128 and set(small.draft_to_target.tolist()) <= set(big.draft_to_target.tolist())
    rows = torch.searchsorted(big.draft_to_target, small.draft_to_target)
    assert torch.equal(small.lm_head.weight, big.lm_head.weight[rows]) and torch.equal(small.fc.weight, big.fc.weight)
    outputs = [t for l in (trimmed / SAMPLES).read_text().splitlines() for t in json.loads(l)["output_ids"]]
    kept = set(small.draft_to_target.tolist())
    dropped = set(big.draft_to_target.tolist()) - kept
    assert max(outputs.count(t) for t in dropped) <= min(outputs.count(t) for t in kept if t not in (0, 1, 2))
    assert main(["train-draft", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "t4"), *ARGS,
                 "--epochs", "0"]) == 2  # nothing to trim or evaluate without --init-from
    assert "needs init_from" in capsys.readouterr().err

    # another target: the head and the run directory are refused
    other_dir = make_tiny_model_dir(tmp_path / "other", "llama", tokenizer_dir=tiny_llama_dir, hidden_size=32,
                                    head_dim=8)
    other = load_model(str(other_dir), EngineConfig(model=str(other_dir)))
    with pytest.raises(EagleTargetMismatch, match="trained for another target"):
        load_head(out, other.runner.model)
    assert train(other_dir, out, "--epochs", "2") == 2
    assert "checkpoint for another target" in capsys.readouterr().err
    assert train(other_dir, tmp_path / "t3", "--init-from", str(out), *SMALL) == 2  # nor fine-tuned for it
    assert "trained for another target" in capsys.readouterr().err

    # the trained head drafts through the engine; greedy output equals plain decoding
    plain, spec = plain_and_eagle(tiny_llama_dir, out, [s["prompt_ids"] for s in samples[:4]])
    assert {r: v["ids"] for r, v in spec.items()} == {r: v["ids"] for r, v in plain.items()}
    drafted = sum(v["spec"].draft_tokens for v in spec.values())
    accepted = sum(v["spec"].accepted_tokens for v in spec.values())
    assert drafted > 0
    print(f"tiny model through the engine: {accepted}/{drafted} draft tokens accepted")


def test_bad_options_are_one_clear_error(tiny_llama_dir, tmp_path, capsys):
    assert train(tiny_llama_dir, tmp_path / "x", "--minutes", "0") == 2
    assert "--minutes must be > 0" in capsys.readouterr().err
    assert train(tiny_llama_dir, tmp_path / "x", "--ttt-steps", "0") == 2
    assert "ttt_steps must be >= 1" in capsys.readouterr().err
    assert train(tiny_llama_dir, tmp_path / "x", "--temperature", "-0.5") == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
    assert train(tiny_llama_dir, tmp_path / "x", "--self-prompts", "-1") == 2
    assert "self_prompts must be >= 0" in capsys.readouterr().err
    assert train(tiny_llama_dir, tmp_path / "x", "--no-corpus") == 2
    assert "without the corpus, give prompts (--prompts) or self-written ones" in capsys.readouterr().err
    assert train(tiny_llama_dir, tmp_path / "x", "--prompts", str(tmp_path / "none.jsonl")) == 2
    assert "--prompts" in (err := capsys.readouterr().err) and "none.jsonl: prompt not found" in err
    assert train(tiny_llama_dir, tmp_path / "x", "--self-prompt-openers", "Describe") == 2
    assert "give self_prompts too" in capsys.readouterr().err
    assert train(tiny_llama_dir, tmp_path / "x", "--self-prompts", "4", "--self-prompt-openers", "Describe| |Why") == 2
    assert "a self-prompt opener must have words in it" in capsys.readouterr().err
    assert train(tiny_llama_dir, tmp_path / "x", "--self-prompts", "4", "--self-prompt-temperature", "0") == 2
    assert "self_prompt_temperature must be > 0" in capsys.readouterr().err
    assert train(tiny_llama_dir, tmp_path / "x", "--gen-batch-size", "0") == 2
    assert "gen_batch_size must be >= 1" in capsys.readouterr().err
    assert train(tiny_llama_dir, tmp_path / "x", "--device", "tpu") == 2
    assert "device 'tpu' is not one of auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert train(tiny_llama_dir, tmp_path / "x", "--device", "cuda") == 2
        assert "torch sees no CUDA device on this machine" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_train_on_a_gpu_then_resume_on_the_cpu(tiny_llama_dir, tmp_path, capsys):
    """Where torch sees a GPU the target and the head train on it; the checkpoint resumes on the
    CPU, and the head drafts losslessly through the (CPU) engine."""
    out = tmp_path / "gpu"
    assert train(tiny_llama_dir, out, "--epochs", "1", "--device", "cuda") == 0
    cap = capsys.readouterr()
    assert "on cuda:0, " in cap.err and "held-out α by draft position" in cap.out
    steps1 = json.loads((out / CONFIG_FILE).read_text())["training"]["step"]
    assert train(tiny_llama_dir, out, "--epochs", "2", "--device", "cpu") == 0
    assert f"resumed at step {steps1}" in capsys.readouterr().err
    prompts = [json.loads(line)["prompt_ids"] for line in (out / SAMPLES).read_text().splitlines()[:4]]
    plain, spec = plain_and_eagle(tiny_llama_dir, out, prompts)
    assert {r: v["ids"] for r, v in spec.items()} == {r: v["ids"] for r, v in plain.items()}
    assert sum(v["spec"].draft_tokens for v in spec.values()) > 0


def test_self_written_requests_are_woven_into_the_corpus(tiny_llama_dir, tmp_path, capsys):
    """--self-prompts: the requests file is read back (here seeded with three requests, as if the
    target had written them: a random model hardly ever ends a turn) and the attempts it lacks are
    written by the target; the kept ones alternate with the corpus' prompts, and the held-out
    report has a 'self' row."""
    from cluster.models.tokenizer import chat_token_ids, load_tokenizer
    from cluster.training.self_prompts import REQUESTS

    out = tmp_path / "self"
    written = ["How should I plan a small vegetable garden for a sunny balcony?",
               "Can you explain what a hash table is, with a short example?",
               "Write a friendly note inviting my neighbours to a street party."]
    (out / REQUESTS).parent.mkdir(parents=True)
    (out / REQUESTS).write_text("".join(json.dumps({"index": i, "seed": 0, "text": t, "ended": True}) + "\n"
                                        for i, t in enumerate(written)))
    assert train(tiny_llama_dir, out, "--epochs", "1", "--self-prompts", "4", "--tokens", "700",
                 "--gen-batch-size", "4") == 0
    cap = capsys.readouterr()
    assert "only 3 of 4 passed the filters" in cap.err  # the tiny target's own attempts never end
    attempts = [json.loads(l) for l in (out / REQUESTS).read_text().splitlines()]
    assert len(attempts) == 16 and [a["index"] for a in attempts] == list(range(16))  # 4 x 4 attempts at most
    tok = load_tokenizer(tiny_llama_dir)
    by_index = {json.loads(l)["index"]: json.loads(l)["prompt_ids"] for l in (out / SAMPLES).read_text().splitlines()}
    where = {i: k for k, text in enumerate(written) for i, ids in by_index.items()
             if ids == chat_token_ids(tok, [{"role": "user", "content": text}])}
    # prompts 0, 2, 4 of the woven list (a corpus prompt over the length limit is skipped, shifting one)
    assert sorted(where.values()) == [0, 1, 2] and min(where) == 0 and max(where) <= 5
    assert all(where[i] < where[j] for i in where for j in where if i < j)  # in the order written
    by_source = [json.loads(l) for l in (out / LOG).read_text().splitlines()][-1]["by_source"]
    assert "self" in by_source and by_source["self"]["anchors"] > 0  # index 0 is held out
    assert "  self: [" in cap.out


def test_your_own_prompts_alone_or_in_turn_with_the_corpus(tiny_llama_dir, tmp_path, capsys):
    """--prompts FILE: its usable rows, encoded as the service would, are the prompts (alone with
    --no-corpus, or in turn with the corpus), their segments the held-out report's sources; the
    rows' own max_tokens and sampling are said to be unused; a changed file is refused on resume."""
    from cluster.models.tokenizer import chat_token_ids, load_tokenizer

    tok = load_tokenizer(tiny_llama_dir)
    texts = [f"Tell me about the {w} of a small harbour town." for w in
             ("fishermen", "bakers", "ferries", "gulls", "storms", "markets", "lighthouse", "tides")]
    rows = [{"segment": "chat" if i % 2 else "story", "chat": True, "prompt": t, "max_tokens": 300}
            for i, t in enumerate(texts)] + [{"segment": "json", "chat": True, "prompt": "x", "regex": "a+"}]
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps(r) + "\n" for r in rows))
    want = [chat_token_ids(tok, [{"role": "user", "content": t}]) for t in texts]

    alone = tmp_path / "alone"
    assert train(tiny_llama_dir, alone, "--epochs", "1", "--prompts", str(mine), "--no-corpus") == 0
    cap = capsys.readouterr()
    assert f"--prompts {mine}: 8 prompts, 1 with json_schema, regex or grammar" in cap.err
    assert "their max_tokens and sampling settings are not used (--max-new-tokens 16" in cap.err
    assert "8 prompts to draw from in turn until --tokens (4 prompts:chat, 4 prompts:story;" in cap.err
    assert "data: samples by source: 4 prompts:chat, 4 prompts:story" in cap.err  # what was generated
    samples = {json.loads(l)["index"]: json.loads(l)["prompt_ids"] for l in (alone / SAMPLES).read_text().splitlines()}
    assert samples == dict(enumerate(want))  # every prompt answered, in file order, nothing else
    by_source = [json.loads(l) for l in (alone / LOG).read_text().splitlines()][-1]["by_source"]
    assert set(by_source) == {"prompts:story"}  # index 0, the only held-out one, is a story
    assert "  prompts:story: [" in cap.out

    # the same file's content changed: the run's samples answer other prompts, refused
    mine.write_text("".join(json.dumps({**r, "prompt": r["prompt"] + "!"}) + "\n" for r in rows[:8]))
    assert train(tiny_llama_dir, alone, "--epochs", "1", "--prompts", str(mine), "--no-corpus") == 2
    assert "answer other prompts than this run's" in capsys.readouterr().err

    mixed = tmp_path / "mixed"
    assert train(tiny_llama_dir, mixed, "--epochs", "1", "--prompts", str(mine), "--tokens", "1000",
                 "--gen-batch-size", "4") == 0
    err = capsys.readouterr().err
    assert "prompts:chat, 4 prompts:story" in err and "data: samples by source: " in err
    generated = err.split("data: samples by source: ")[1].split("\n")[0]
    assert "prompts:chat" in generated and "chat" in generated.replace("prompts:chat", "")  # yours and the corpus'
    by_index = {json.loads(l)["index"]: json.loads(l)["prompt_ids"] for l in (mixed / SAMPLES).read_text().splitlines()}
    changed = [chat_token_ids(tok, [{"role": "user", "content": t + "!"}]) for t in texts]
    where = [i for i in sorted(by_index) if by_index[i] in changed]
    assert [by_index[i] for i in where] == changed[:len(where)] and len(where) >= 3  # in file order
    # in turn with the corpus: your first prompt first, a corpus one next (a corpus prompt over the
    # length limit is left out after weaving, so two of yours may meet)
    corpus_between = [i for i in by_index if i < where[-1] and i not in where]
    assert where[0] == 0 and 1 in corpus_between and len(corpus_between) >= len(where) // 2

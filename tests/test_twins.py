"""Twin drafters and resumable training on the dummy SmolLM2 shape (random weights, CPU,
seconds): resume equals straight training bit for bit; twins share data and settings and differ
only in their head; a twin of another group is refused; the ρ_τ reference decodes with the twin."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from conftest import job_config as composed
from flashspec.errors import FlashSpecError
from flashspec.heads import LowRankChoice
from flashspec.models import load_model
from flashspec.training.data import DataSpec, DistillData
from flashspec.training.run import JobOptions, run_twins
from flashspec.training.train import Resumable, TrainConfig, train
from flashspec.training.twins import check_twins, head_tag, read_twin

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "dummy:smollm2-135m"
TINY = TrainConfig(steps=6, batch_tokens=48, max_len=16, warmup=1, eval_every=2, eval_prompts=0,
                   val_fraction=0.25, log_every=1, unroll=2, noise=0.05, out_norm=True,
                   in_norm=True)


@pytest.fixture(scope="module")
def dummy():
    torch.set_num_threads(1)
    return load_model(SOURCE)


def tiny_data(target, n_seq: int = 8, k: int = 4) -> DistillData:
    """Random sequences in the target's vocabulary with random features and top-k log-probs."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(6, 14, (n_seq,), generator=gen)
    n, d = int(lengths.sum()), target.shape.hidden_size
    logp = torch.log_softmax(torch.randn(n, k + 2, generator=gen), -1)[:, :k]
    meta = {"key": "tiny", "target": "dummy", "sequences": [
        {"prompt_id": f"p{i}"} for i in range(n_seq)]}
    return DistillData(torch.randint(0, 1000, (n,), generator=gen),
                       torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                       torch.full((n_seq,), 3), torch.randn(n, d, generator=gen).half(),
                       torch.randint(0, 1000, (n, k), generator=gen, dtype=torch.int32),
                       logp.sort(-1, descending=True).values, meta)


@pytest.fixture(scope="module")
def svd_head(dummy):
    target, _ = dummy
    return LowRankChoice(rank=8, init="svd").build(target.lm_head_weight).float()


def test_resume_equals_straight_training(dummy, svd_head, tmp_path):
    """3 steps, pause (state saved), resume, 3 more = 6 straight: same drafter, head, history;
    an epoch boundary, the noise stream and evaluations fall inside the run."""
    target, _ = dummy
    data = tiny_data(target)
    lowrank = lambda _: copy.deepcopy(svd_head).requires_grad_(True)   # the same start each time
    straight = train(target, data, TINY, lowrank(target), progress=False)
    state = tmp_path / "train_state.pt"
    first = train(target, data, TINY, lowrank(target), progress=False,
                  resumable=Resumable(state, call_steps=3, fingerprint="x"))
    assert first.paused and first.steps == 3 and state.is_file()
    second = train(target, data, TINY, lowrank(target), progress=False,
                   resumable=Resumable(state, fingerprint="x"))
    assert not second.paused and second.steps == TINY.steps
    for a, b in [(straight.module, second.module), (straight.head, second.head)]:
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    drop = lambda h: [{k: v for k, v in r.items() if k != "train_s"} for r in h]
    assert drop(straight.history) == drop(second.history)
    with pytest.raises(FlashSpecError, match="other data or settings"):
        train(target, data, dataclasses.replace(TINY, lr=2e-3), lowrank(target), progress=False,
              resumable=Resumable(state, fingerprint="x"))


def job(root: Path, **kw) -> JobOptions:
    data = DataSpec(datasets={"humaneval": 1, "gsm8k": 1}, samples={"humaneval": 1, "gsm8k": 1},
                    max_new_tokens=6, batch_size=4)
    cfg = dataclasses.replace(TINY, val_fraction=0.0, max_len=160, batch_tokens=320)  # > prompts
    return JobOptions(data=[data], train=cfg, out_dir=root / "twins", cache_dir=root / "cache",
                      source=SOURCE, progress=False, **kw)


@pytest.fixture(scope="module")
def group(dummy, tmp_path_factory) -> dict:
    """A twin group (full, d/64 = r9) and the full-head drafter of another seed on the same
    data (another group), exported as ex_<tag> and other_full."""
    target, tok = dummy
    root = tmp_path_factory.mktemp("twins")
    res = run_twins(target, tok, job(root, export=str(root / "ex_{head}.safetensors")),
                    ["full", "d/64"])
    other = job(root / "b", export=str(root / "other_{head}.safetensors"))
    other = dataclasses.replace(other, train=dataclasses.replace(other.train, seed=1),
                                cache_dir=root / "cache")
    run_twins(target, tok, other, ["full"])
    return {"res": res, "full": root / "ex_full.safetensors", "low": root / "ex_r9.safetensors",
            "other": root / "other_full.safetensors", "root": root}


def test_twins_share_data_and_settings_and_differ_in_head(group):
    """Same twin key, data and training settings; the low-rank twin holds its trained head,
    the full one none; another seed is another group, refused as the ρ_τ reference."""
    assert group["res"]["finished"] and list(group["res"]["heads"]) == ["full", "r9"]
    full, low = read_twin(group["full"]), read_twin(group["low"])
    assert full["key"] == low["key"] and full["head"] == "full" and low["head"] == "r9"
    assert full["checkpoint_head"] is None and low["checkpoint_head"] == {"kind": "lowrank", "rank": 9}
    metas = [json.loads(p.with_suffix(".json").read_text())["provenance"]
             for p in (group["full"], group["low"])]
    assert metas[0]["data"] == metas[1]["data"] and metas[0]["train"] == metas[1]["train"]
    assert check_twins(str(group["low"]), str(group["full"]))["key"] == low["key"]
    with pytest.raises(FlashSpecError, match="not the full-head one"):
        check_twins(str(group["full"]), str(group["low"]))
    assert read_twin(group["other"])["key"] != low["key"]
    with pytest.raises(FlashSpecError, match="not trained the same way"):
        check_twins(str(group["low"]), str(group["other"]))
    status = json.loads((group["root"] / "twins" / "twins.json").read_text())
    assert status["finished"] and set(status["heads"]) == {"full", "r9"}
    assert not list((group["root"] / "cache").glob("*.partial"))   # removed once cached


def test_twins_refuse_a_schedule_that_ends_on_wall_time(dummy, tmp_path):
    """A time budget would give the cheaper low-rank twin more steps than its full-head twin."""
    target, tok = dummy
    timed = job(tmp_path)
    timed = dataclasses.replace(timed, train=dataclasses.replace(timed.train, time_budget_s=60.0))
    with pytest.raises(FlashSpecError, match="twins train by steps"):
        run_twins(target, tok, timed, ["full", "d/64"])


def test_generation_resumes_after_the_last_stored_group(dummy, tmp_path):
    """A generation killed while writing its second job group continues after the first and
    gives the tokens of an uninterrupted one (T = 1: each group samples from its own seed)."""
    from flashspec.training.data import generate
    target, tok = dummy
    spec = DataSpec(datasets={"humaneval": 3}, samples={"humaneval": 2}, max_new_tokens=4,
                    batch_size=1)   # 6 jobs: groups of 4 and 2
    straight, _ = generate(target, tok, spec, False)
    partial = tmp_path / "partial"
    generate(target, tok, spec, False, partial=partial)
    lines = (partial / "groups.jsonl").read_text().splitlines()
    assert len(lines) == 2
    (partial / "groups.jsonl").write_text(lines[0] + "\n" + lines[1][:40])   # a torn last line
    resumed, meta = generate(target, tok, spec, False, partial=partial)
    assert meta["generation"]["resumed_groups"] == 1
    assert [s.tokens for s in resumed] == [s.tokens for s in straight]
    assert len({tuple(s.tokens) for s in straight}) == len(straight)   # samples, not copies


def reference_plan(dummy, checkpoint: Path, twin: Path | None, *head: str):
    from experiments.decode import build_methods
    from flashspec.core import SamplingParams
    target, tok = dummy
    cfg = composed("experiment=decode", f"target.source={SOURCE}", "drafters=eagle_lowrank",
                   f"drafters.drafters.eagle_lr72.checkpoint={checkpoint}", "head=lowrank",
                   *(head or ["head.rank=9"]), "experiment.methods=[spec]",
                   "experiment.references=[full_head]",
                   *([f"+drafters.drafters.eagle_lr72.twin={twin}"] if twin else []))
    return build_methods(cfg, target, tok, SamplingParams(0.0, 0, 1.0), [2])


def drafter_of(plan, method: str):
    """The drafter a method's engine decodes with (the engine its run closes over)."""
    from flashspec.engine import SpecEngine
    run = next(m.run for m in plan.methods if m.name == method)
    engine = next(c.cell_contents for c in run.__closure__
                  if isinstance(c.cell_contents, SpecEngine))
    return engine.drafters[0]


def test_full_head_reference_decodes_with_the_twin(dummy, group):
    """With ``twin:`` the ρ_τ reference is the twin drafter (its weights, the full head) and
    says so; without it, the low-rank drafter's own backbone; a twin of another group or a run
    head of another rank than the checkpoint's is refused."""
    from flashspec.drafters.eagle_checkpoint import load_eagle
    target, _ = dummy
    plan = reference_plan(dummy, group["low"], group["full"])
    assert plan.full_head.startswith("ref_twin:") and plan.reference == "twin"
    assert plan.head["rho_tau_reference"] == "twin"
    want = {k: v.float() for k, v in load_eagle(group["full"], target)[0].state_dict().items()}
    for name, checkpoint in ((plan.full_head, group["full"]), (plan.variant, group["low"])):
        got = drafter_of(plan, name).module.state_dict()
        ref = {k: v.float() for k, v in load_eagle(checkpoint, target)[0].state_dict().items()}
        assert all(torch.equal(got[k].float(), ref[k]) for k in ref)
    assert not all(torch.equal(drafter_of(plan, plan.variant).module.state_dict()[k].float(), v)
                   for k, v in want.items())   # the two drafters differ: the test can tell
    plain = reference_plan(dummy, group["low"], None)
    assert plain.full_head.startswith("ref_full_head:") and plain.reference == "backbone"
    with pytest.raises(FlashSpecError, match="not trained the same way"):
        reference_plan(dummy, group["low"], group["other"])
    for other_head in (["head.rank=12", "head.init=svd"], ["head.rank=9", "head.init=svd"]):
        with pytest.raises(FlashSpecError, match="rank-9 drafter"):
            reference_plan(dummy, group["low"], group["full"], *other_head)


def test_head_tags_resolve_against_the_targets_d():
    assert [head_tag(h, 576) for h in ("full", "d/8", "d/16", "d/32", 40)] == \
        ["full", "r72", "r36", "r18", "r40"]
    assert [head_tag(h, 1536) for h in ("d/8", "d/16", "d/32")] == ["r192", "r96", "r48"]


def test_a_calls_budget_counts_from_when_the_call_started(tmp_path):
    """``call_budget_s`` counts from ``started_at`` (experiments/train_drafter.py passes its own
    start, so loading the target and generating data count against a device call's limit)."""
    from flashspec.training.run import call_stop
    assert call_stop(job(tmp_path)) is None
    assert call_stop(job(tmp_path, call_budget_s=60, started_at=1000.0)) == 1060.0
    import time
    before = time.time()
    stop = call_stop(job(tmp_path, call_budget_s=60))   # no start given: from now
    assert before + 60 <= stop <= time.time() + 60

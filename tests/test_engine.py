"""The decode engine on the real SmolLM2 model (fp32, CPU): greedy speculative == greedy target."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from flashspec.bandits import Policy
from flashspec.core import Arm, SamplingParams
from flashspec.drafters import DraftContext, Drafter, ModelDrafter, NgramDrafter
from flashspec.engine import SpecEngine
from flashspec.resident import ResidentLoop
from flashspec.errors import FlashSpecError
from flashspec.models import LlamaLM, load_model, smollm2_dir

pytestmark = pytest.mark.slow

TEXTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is 17 * 23? Explain briefly.",
    "List three colours of the rainbow.",
    "def is_palindrome(s):\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n",
]
# 24 new tokens (it was 40): each drafter takes 9 to 24 steps a row, with rejections and
# accepted drafts (prompt lookup; the NF4 copy accepts over half); row 1 ends at its EOS after
# 13 tokens, the others at the budget. Greedy equality is checked token by token: a longer
# run repeats the same kinds of steps.
N_NEW = 24


@pytest.fixture(scope="module")
def smol() -> tuple[LlamaLM, object]:
    return load_model("smollm2")


@pytest.fixture(scope="module")
def prompts(smol) -> list[list[int]]:
    _, tok = smol
    ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                   return_dict=True)["input_ids"] for t in TEXTS]
    assert len({len(p) for p in ids}) > 1, "prompts must have different lengths"
    return ids


@pytest.fixture(scope="module")
def reference(smol, prompts) -> list[list[int]]:
    """Target-only greedy tokens, one prompt at a time, with a plain full-recompute loop."""
    model, tok = smol
    outs = []
    for p in prompts:
        seq = list(p)
        with torch.inference_mode():
            for _ in range(N_NEW):
                ids = torch.tensor([seq])
                logits = model(ids, torch.arange(len(seq))[None])
                nxt = int(logits[0, -1].argmax())
                seq.append(nxt)
                if nxt == tok.eos_token_id:
                    break
        outs.append(seq[len(p):])
    return outs


def small_model_dir(out: Path, n_layers: int = 8, tokens: list[int] | None = None) -> Path:
    """A separate HF causal LM on disk: SmolLM2 cut to its first layers (same tokenizer).
    ``tokens``: keep only these vocabulary rows (token id ``tokens[i]`` becomes i; the saved
    tokenizer no longer matches the ids, so callers feed ids, not text)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    src = smollm2_dir()
    cfg = AutoConfig.from_pretrained(src)
    cfg.num_hidden_layers = n_layers
    full = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = full.state_dict()
    if tokens is not None:
        cfg.vocab_size = len(tokens)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in state:
                state[name] = state[name][torch.tensor(tokens)]
    small = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    small.load_state_dict(state, strict=False)
    small.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def load_small_model(tmp_path_factory, n_layers: int, tokens: list[int] | None = None):
    """:func:`small_model_dir` loaded as a checkpoint on disk is, its directory then removed: a
    copy is 100 to 250 MB in fp32, and a module-scoped fixture's files would otherwise stay on
    the CI box's disk until the session ends."""
    directory = small_model_dir(tmp_path_factory.mktemp(f"small{n_layers}"), n_layers, tokens)
    try:
        return load_model(str(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


ARMS = {"ngram": Arm("ngram", 4), "layerskip": Arm("skip12", 3), "model": Arm("small8", 3)}


@pytest.fixture(scope="module")
def drafters(smol, tmp_path_factory) -> dict[str, Drafter]:
    """The drafters of :data:`ARMS`, by kind."""
    model, tok = smol
    directory = small_model_dir(tmp_path_factory.mktemp("small"))
    small = ModelDrafter.separate(DraftContext(model, tok), "small8", source=str(directory))
    shutil.rmtree(directory)   # loaded: see load_small_model
    return {"ngram": NgramDrafter(), "layerskip": ModelDrafter(model, list(range(12)), name="skip12"),
            "model": small}


def test_ar_engine_matches_full_recompute(smol, prompts, reference):
    model, tok = smol
    engine = SpecEngine(model, [Arm()], eos_ids=[tok.eos_token_id])
    got = [engine.generate([p], N_NEW).rows[0].tokens for p in prompts]
    assert got == reference


@pytest.mark.parametrize("kind", ["ngram", "layerskip", "model"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_target(smol, prompts, reference, drafters, kind, batch):
    model, tok = smol
    engine = SpecEngine(model, [ARMS[kind]], eos_ids=[tok.eos_token_id], drafters=[drafters[kind]])
    if batch == 1:
        rows = [engine.generate([p], N_NEW).rows[0] for p in prompts]
    else:
        rows = engine.generate(prompts, N_NEW).rows
    assert [r.tokens for r in rows] == reference
    assert sum(r.n_proposed for r in rows) > 0
    assert all(0 <= r.n_accepted <= r.n_proposed for r in rows)


class Cycle(Policy):
    """A policy that walks through the arms in turn (widths change every step)."""

    name = "cycle"
    learns = False
    i = -1

    def select_many(self, context=None) -> np.ndarray:
        self.i = (self.i + 1) % self.n_arms
        return np.full(self.n_envs, self.i, dtype=np.int64)


@pytest.mark.parametrize("batch", [1, 4])
def test_static_step_path_equals_target(smol, prompts, reference, drafters, batch):
    """graphs=True (the captured stepper: device state, attention over the whole static cache;
    eager on a CPU) is exact."""
    model, tok = smol
    arm_set = [ARMS["ngram"], Arm("ngram", 2), Arm()]
    engine = SpecEngine(model, arm_set, Cycle(len(arm_set)), eos_ids=[tok.eos_token_id], graphs=True,
                        drafters=[drafters["ngram"]])
    rows = ([engine.generate([p], N_NEW).rows[0] for p in prompts] if batch == 1
            else engine.generate(prompts, N_NEW).rows)
    assert [r.tokens for r in rows] == reference
    assert isinstance(engine.stepper, ResidentLoop) and engine.chunk == 1


def test_ragged_batch_keeps_each_rows_acceptance(smol, prompts, drafters):
    """Rows in one batch accept different counts in the same step (no cut to the batch minimum)."""
    model, tok = smol
    engine = SpecEngine(model, [ARMS["ngram"]], eos_ids=[tok.eos_token_id],
                        drafters=[drafters["ngram"]])
    rows = engine.generate(prompts, N_NEW).rows
    alone = [engine.generate([p], N_NEW).rows[0] for p in prompts]
    assert [r.n_accepted for r in rows] == [r.n_accepted for r in alone]
    assert len({r.steps for r in rows}) > 1


def test_length_limit_and_eos_per_row(smol, prompts):
    model, tok = smol
    engine = SpecEngine(model, [Arm("ngram", 4)], eos_ids=[tok.eos_token_id],
                        drafters=[NgramDrafter()])
    rows = engine.generate(prompts, 7).rows
    assert all(len(r.tokens) <= 7 for r in rows)
    eos_rows = SpecEngine(model, [Arm()], eos_ids=[tok.eos_token_id]).generate(prompts[1:2], 200)
    toks = eos_rows.rows[0].tokens
    assert toks[-1] == tok.eos_token_id and tok.eos_token_id not in toks[:-1]


def test_sampling_is_reproducible_and_differs_by_seed(smol, prompts, drafters):
    model, tok = smol
    params = SamplingParams(temperature=1.0, top_k=50)
    run = lambda seed: SpecEngine(model, [ARMS["layerskip"]], params=params, seed=seed,
                                  drafters=[drafters["layerskip"]]).generate(prompts[:2], 16).rows
    a, b, c = run(1), run(1), run(2)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.tokens for r in a] != [r.tokens for r in c]


def test_a_warm_up_call_teaches_the_policy_nothing(smol, prompts, drafters):
    """decode.py's untimed warm-up runs the bandit's engine with ``learn=False``: its steps are a
    cold start's (first use of each shape), and an arm timed there was priced slow for the
    whole run (UCB1 on the design-card sweep). The same call with learning on updates it."""
    from flashspec.bandits import UCB1
    model, tok = smol
    arms = [ARMS["ngram"], ARMS["layerskip"]]
    made = {}
    for learn in (False, True):
        policy = UCB1(len(arms), reward="tps")
        engine = SpecEngine(model, arms, policy, eos_ids=[tok.eos_token_id],
                            drafters=[drafters["ngram"], drafters["layerskip"]])
        made[learn] = engine.generate(prompts[:1], 8, learn=learn).rows[0]
        steps = policy.rates.steps.sum()
        assert (steps > 0) == learn and (policy.t > 0) == learn, (learn, steps, policy.t)
    assert made[False].tokens == made[True].tokens    # greedy: the tokens are the same


def test_bad_inputs(smol):
    model, _ = smol
    with pytest.raises(FlashSpecError, match="empty prompt"):
        SpecEngine(model, [Arm()]).generate([[]], 4)
    with pytest.raises(FlashSpecError, match="context window"):
        SpecEngine(model, [Arm()]).generate([[1] * 8190], 16)
    with pytest.raises(FlashSpecError, match="gamma"):
        SpecEngine(model, [Arm("ngram", 0)], drafters=[NgramDrafter()])
    with pytest.raises(FlashSpecError, match="no drafter named 'ngram'"):
        SpecEngine(model, [Arm("ngram", 2)])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=1.5)


def test_nf4_quantized_drafter_keeps_greedy_exact(smol, prompts, reference):
    """A separate NF4 (bitsandbytes) copy of the target drafts; output stays the target's."""
    model, tok = smol
    nf4, _ = load_model("smollm2", quantization="nf4")
    engine = SpecEngine(model, [Arm("nf4", 4)], eos_ids=[tok.eos_token_id],
                        drafters=[ModelDrafter(nf4, None, name="nf4")])
    rows = [engine.generate([p], N_NEW).rows[0] for p in prompts[:2]]
    assert [r.tokens for r in rows] == reference[:2]
    assert sum(r.n_accepted for r in rows) / sum(r.n_proposed for r in rows) > 0.5

"""The ``qwen2`` architecture (Qwen2.5-Coder 1.5B / 0.5B) in the native decoder, against
transformers' own ``Qwen2ForCausalLM``.

Tiny random models keep the real attention geometry of each target (12 query heads over 2 kv
heads of dimension 128, as the 1.5B; 14 over 2 of dimension 64, as the 0.5B; hence the real
hidden sizes 1536 and 896), rope θ = 1e6, rms eps 1e-6, q/k/v biases and the tie flag both ways;
only the layer count, the MLP width and the vocabulary are cut. The model is saved with
``save_pretrained`` and read back by :func:`flashspec.models.load_model`, the path a real
checkpoint takes (config checks, state-dict names, the tied head dropped from the file). The
native logits (reference layers and fused layers, prefill then cached steps) equal
transformers' full-sequence logits in fp32; the engine's greedy output with a separate qwen2
draft LM of the other geometry equals target-only decoding.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flashspec.drafters import DraftContext, ModelDrafter, NgramDrafter
from flashspec.core import Arm
from flashspec.engine import SpecEngine
from flashspec.models import fused, load_model, smollm2_dir
from flashspec.models.llama import LlamaLM

VOCAB = 256
# (query heads, kv heads, head dim) of Qwen2.5-Coder-1.5B and -0.5B
GEOMETRY = {"1.5b": (12, 2, 128), "0.5b": (14, 2, 64)}
# fp32 agreement: within 2e-6 of the largest |logit| (about 17 fp32 ulps of it; up to 4 untied,
# up to 1000 tied, where the embedding of std 1 is the head). transformers' eager attention and
# the native SDPA / fused kernels sum in other orders: against a float64 run of the same model,
# transformers' own fp32 logits are off by 5e-7 (untied) and 2e-7 (tied) of that scale, the
# native ones by at most 7e-7 and 4e-7.
REL = 2e-6


def qwen2_dir(out: Path, geometry: str, tie: bool, layers: int = 2, seed: int = 0) -> Path:
    """A random ``Qwen2ForCausalLM`` of ``geometry`` saved as an HF directory (with a tokenizer,
    as :func:`load_model` expects one). Every parameter is drawn so that it matters: biases
    far from zero, norm weights around one, an untied head unlike the embedding."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    heads, kv_heads, head_dim = GEOMETRY[geometry]
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=heads * head_dim, intermediate_size=96,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=tie, max_position_embeddings=512)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                torch.nn.init.normal_(p, mean=1.0, std=0.2)
            elif name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.5)
            elif "embed" in name:
                torch.nn.init.normal_(p, std=1.0)
            else:
                torch.nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[-1]))
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm2_dir()).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def qwen2_dirs(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    return {(g, tie): qwen2_dir(tmp_path_factory.mktemp(f"qwen2-{g}-{tie}"), g, tie)
            for g in GEOMETRY for tie in (False, True)}


@pytest.fixture(scope="module")
def one_layer_dirs(tmp_path_factory) -> dict[str, Path]:
    """One-layer models for the engine (its fused steps are interpreted): the 1.5B geometry
    untied (the target), the 0.5B tied (its draft LM)."""
    return {g: qwen2_dir(tmp_path_factory.mktemp(f"qwen2-{g}-1"), g, tie=g == "0.5b", layers=1,
                         seed=int(g == "0.5b")) for g in GEOMETRY}


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(tokens).logits


def native_steps(model: LlamaLM, tokens: torch.Tensor, steps: list[int], use_fused: bool
                 ) -> torch.Tensor:
    """Logits of ``tokens`` [B, T] from a prefill of ``steps[0]`` tokens and cached steps of the
    following sizes, through the reference or the fused decode layers."""
    model.decode_layers = fused.LAYERS if use_fused else None
    cache, outs, start = model.new_cache(tokens.shape[0], 32), [], 0
    with torch.inference_mode():
        for n in steps:
            pos = torch.arange(start, start + n).expand(tokens.shape[0], n)
            outs.append(model(tokens[:, start:start + n], pos, cache))
            start += n
    model.decode_layers = None
    assert start == tokens.shape[1]
    return torch.cat(outs, 1)


@pytest.mark.parametrize("geometry", list(GEOMETRY))
@pytest.mark.parametrize("tie", [False, True])
def test_native_qwen2_logits_equal_transformers(qwen2_dirs, geometry, tie):
    """Prefill of 6 tokens, then cached steps of 1, 1, 1 and 3 tokens: every position's fp32
    logits equal transformers' (one full forward), through the reference layers and through the
    fused decode layers (Triton, interpreted), for both rows of a batch."""
    directory = qwen2_dirs[geometry, tie]
    model, _ = load_model(str(directory))
    heads, kv_heads, head_dim = GEOMETRY[geometry]
    s = model.shape
    assert (s.num_heads, s.num_kv_heads, s.head_dim) == (heads, kv_heads, head_dim)
    assert s.attention_bias and s.rms_eps == 1e-6 and s.tie_embeddings == tie
    assert (model.lm_head.weight is model.embed_tokens.weight) == tie
    torch.testing.assert_close(model.inv_freq, 1.0 / 1e6 ** (torch.arange(0, head_dim, 2) / head_dim))
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    want = hf_logits(directory, tokens)
    assert want.std() > 0.5, "logits this flat would hide a missing bias or a wrong head"
    tol = dict(rtol=0.0, atol=REL * float(want.abs().max()))
    ref = native_steps(model, tokens, [6, 1, 1, 1, 3], use_fused=False)
    torch.testing.assert_close(ref, want, **tol)
    fused.fuse_model(model)
    got = native_steps(model, tokens, [6, 1, 1, 1, 3], use_fused=True)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("drafter,use_fused", [("draft_lm", True), ("self", False),
                                               ("ngram", False)])
def test_engine_greedy_qwen2_equals_target_only(one_layer_dirs, drafter, use_fused):
    """The 1.5B geometry (untied head) as target, fp32: greedy speculative decoding with a chain
    drafter gives target-only (AR) output token for token. ``draft_lm``: a separate qwen2 draft
    LM of the 0.5B geometry (tied head), as conf/drafters/qwen_coder.yaml pairs them, with the
    fused decode layers in both models (as runtime.fused_layers runs them; the interpreter
    makes this the slow case); ``self``: the target's own weights as a separate draft LM, so
    drafts are accepted and the accepted-path bookkeeping runs."""
    target, tok = load_model(str(one_layer_dirs["1.5b"]))
    fused.fuse_model(target, use_fused)
    ctx = DraftContext(target, tok)
    draft = {"draft_lm": lambda: ModelDrafter.separate(
                 ctx, "qwen0.5b", source=str(one_layer_dirs["0.5b"])),
             "self": lambda: ModelDrafter(target, None, name="self"),
             "ngram": lambda: NgramDrafter()}[drafter]()
    arm = Arm(draft.name, 3)
    if drafter == "draft_lm":     # a fused target's separate draft LM is fused too
        assert draft.model.shape.head_dim == 64 and draft.model.fused
    g = torch.Generator().manual_seed(2)
    base = torch.randint(0, VOCAB, (4,), generator=g).tolist()
    prompts = [base * 2, (base * 2)[1:] + [7, 9]]
    ar = SpecEngine(target, [Arm()]).generate(prompts, 8).rows
    spec = SpecEngine(target, [arm], drafters=[draft]).generate(prompts, 8).rows
    assert [r.tokens for r in spec] == [r.tokens for r in ar]
    assert all(len(r.tokens) == 8 for r in ar)
    if drafter == "self":
        assert all(sum(r.accept_hist[1:]) > 0 for r in spec), "every draft should be accepted"


@pytest.mark.parametrize("name,tie,hidden,rank", [("qwen2.5-coder-1.5b", False, 1536, 192),
                                                  ("qwen2.5-coder-0.5b", True, 896, 112)])
def test_dummy_qwen_coder_shapes_are_the_real_ones(name, tie, hidden, rank):
    """``dummy:qwen2.5-coder-*`` builds the native model of the real checkpoint: on the meta
    device (no memory), its parameter names and shapes are exactly transformers'
    ``Qwen2ForCausalLM``'s for that config (tied: the head is the embedding), rope θ = 1e6,
    rms eps 1e-6, q/k/v biases; ``head.rank=d/8`` resolves against the model's d."""
    from transformers import Qwen2ForCausalLM
    from flashspec.heads.choice import resolve_rank
    from flashspec.models.loading import build, dummy_config
    config = dummy_config(name)
    assert config.model_type == "qwen2" and config.vocab_size == 151936
    assert config.rope_parameters["rope_theta"] == 1e6 and config.tie_word_embeddings == tie
    native = build(config, torch.float32, "meta")
    s = native.shape
    assert s.hidden_size == hidden and s.head_dim == {1536: 128, 896: 64}[hidden]
    assert s.attention_bias and s.rms_eps == 1e-6 and s.tie_embeddings == tie
    with torch.device("meta"):
        hf = Qwen2ForCausalLM(config)
    want = {k.removeprefix("model."): tuple(v.shape) for k, v in hf.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in native.state_dict().items()}
    if tie:          # one tensor under two names; load_weights drops the head's copy
        want.pop("lm_head.weight", None)
        assert got.pop("lm_head.weight") == got["embed_tokens.weight"]
    assert got == want
    assert sum(p.numel() for p in native.parameters()) == sum(p.numel() for p in hf.parameters())
    assert resolve_rank("d/8", s.hidden_size) == rank


def test_qwen_coder_drafter_set_builds_against_a_qwen2_target(one_layer_dirs):
    """conf/drafters/qwen_coder.yaml, its draft LM pointed at a local qwen2 directory (as
    ``drafters.drafters.coder05b.source=...`` does), builds its drafters and arms for a qwen2
    target: the draft LM of the other geometry passes the vocabulary and tokenizer checks."""
    from experiments.harness import build_arms, build_drafters
    from test_configs import composed
    target, tok = load_model(str(one_layer_dirs["1.5b"]))
    cfg = composed("drafters=qwen_coder",
                   f"drafters.drafters.coder05b.source={one_layer_dirs['0.5b']}")
    drafters = build_drafters(cfg.drafters, DraftContext(target, tok))
    arms = build_arms(cfg.drafters, drafters)
    assert [a.label for a in arms] == ["coder05b@3", "coder05b@2", "coder05b@4", "coder05b@5",
                                      "ngram@3", "ngram@5"]
    draft = drafters["coder05b"]
    assert isinstance(draft, ModelDrafter) and draft.model.shape.hidden_size == 896
    assert draft.head is draft.model.lm_head       # its own full (tied) head

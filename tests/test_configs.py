"""Every config composes and builds its objects before any model loads; contradictions and
settings that a chosen component would ignore fail at composition with both keys named."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from experiments.harness import build, config_arms, make_planner, make_policy, validate
from flashspec.bandits import Policy
from flashspec.core import Arm
from flashspec.errors import FlashSpecError
from flashspec.heads import FullHeadChoice, LowRankChoice, TruncatedChoice

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ["target", "drafters", "head", "bandit", "planner", "dataset", "hardware", "runtime",
          "logger", "experiment"]
# What each hardware profile runs when the command names no runtime (its defaults list): the
# behaviour every command had before the runtime group split off the hardware one.
DEFAULT_RUNTIME = {"cpu": "eager", "t4": "graphed", "a100": "graphed", "h100": "graphed",
                   "h200": "resident"}
RUNTIME_KEYS = {"verify_backend", "cuda_graphs", "resident_loop",
                "resident_chunk", "fused_layers", "kernels"}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def composed(*overrides: str):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)   # what a running app does: ${hydra:...} resolves
    with open_dict(cfg):
        cfg.output_dir = "/tmp/unused"
    return cfg


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_config_option_composes_and_validates(group, option):
    """The glob(*) check over every file of every group: composes with the defaults, every
    cheap object builds (hardware needing CUDA and the simulation-only oracle are refused)."""
    cfg = composed(f"{group}={option}")
    OmegaConf.to_container(cfg.drafters, resolve=True)
    if group == "hardware" and cfg.hardware.device.startswith("cuda"):
        with pytest.raises(FlashSpecError, match=f"hardware={option} needs CUDA.*hardware=cpu"):
            validate(cfg)
        return
    if group == "target" and option == "hf":   # its source is the user's to give (???)
        with pytest.raises(FlashSpecError, match=r"^target.source is required .*target.source="):
            validate(cfg)
        validate(composed("target=hf", "target.source=some/model"))
        return
    required = {("drafters", "twins"): ["drafters.drafters.eagle_twin.checkpoint",
                                        "drafters.drafters.eagle_twin.twin"],
                ("experiment", "head_decode_qwen_eagle"): ["experiment.drafter.checkpoint"]}
    if (group, option) in required:   # a drafter no checkpoint is committed for (???)
        given = [f"{group}={option}"]
        for key in required[group, option]:
            with pytest.raises(FlashSpecError, match=f"^{key} is required .*{key}="):
                validate(composed(*given))
            given.append(f"{key}=run/eagle_best.safetensors")
        validate(composed(*given))
        return
    if group == "bandit" and option == "oracle":   # simulation only: refused for decoding
        with pytest.raises(FlashSpecError, match="oracle needs the true arm means"):
            validate(cfg)
        return
    validate(cfg)


def test_the_drafter_set_follows_the_target():
    """config.yaml picks drafters=<target>: SmolLM2's trained EAGLE set by default, the 1.5B's own
    EAGLE drafter (at a fixed path under .cache, no drafter of its size is committed) with
    target=qwen2.5-coder-1.5b, prompt lookup where no drafter of the target's is shipped; an
    explicit drafters=... and an experiment's override still win."""
    def drafters(*overrides):
        return sorted(composed(*overrides).drafters.drafters)
    assert drafters() == ["eagle_lr72", "ngram"]
    assert drafters("target=qwen2.5-coder-1.5b") == ["eagle_qwen", "ngram"]
    assert composed("target=qwen2.5-coder-1.5b").drafters.drafters.eagle_qwen.checkpoint == \
        ".cache/drafters/qwen2.5-coder-1.5b.safetensors"
    assert drafters("target=qwen2.5-coder-0.5b") == drafters("target=llama8b_dummy") == ["ngram"]
    assert drafters("target=qwen2.5-coder-1.5b", "drafters=ngram") == ["ngram"]
    assert drafters("experiment=mixed_stream") == ["eagle_lr72", "ngram", "skip10"]
    assert set(options("target")) <= set(options("drafters")), "a target without a drafter set"


def test_every_hardware_names_its_default_runtime():
    """`hardware=<x>` alone runs as it did when the profile held the runtime keys: the CPU the
    eager loop, t4/a100/h100 the graphed step, the h200 the resident loop."""
    assert sorted(DEFAULT_RUNTIME) == options("hardware")
    for hw, mode in DEFAULT_RUNTIME.items():
        cfg = composed(f"hardware={hw}")
        assert cfg.runtime.name == mode and cfg.hydra.runtime.choices.runtime == mode, hw
    assert composed().runtime.name == "eager"   # `python run.py`: the cpu profile


@pytest.mark.parametrize("hw,mode", [(h, r) for h in options("hardware")
                                     for r in options("runtime")])
def test_every_hardware_runtime_pair_composes(hw, mode, caplog):
    """`hardware=<x> runtime=<y>` composes for every pair (a command-line runtime wins over the
    profile's), the keys land in their own group, and builds the Runtime; a graphed or
    resident runtime off CUDA runs uncaptured with one logged line naming both choices."""
    from flashspec.runtime import Runtime
    cfg = composed(f"hardware={hw}", f"runtime={mode}")
    assert cfg.hardware.name == hw and cfg.runtime.name == mode
    assert cfg.hydra.runtime.choices.runtime == mode
    assert not RUNTIME_KEYS & set(cfg.hardware), f"hardware={hw} holds runtime keys"
    assert RUNTIME_KEYS <= set(cfg.runtime)
    rt = build(cfg.runtime)
    assert isinstance(rt, Runtime) and rt.name == mode
    assert rt.resident_loop == (mode == "resident") and rt.cuda_graphs == (mode != "eager")
    if cfg.hardware.device.startswith("cuda"):   # no CUDA here: the profile is refused, by name
        with pytest.raises(FlashSpecError, match=f"hardware={hw} needs CUDA"):
            validate(cfg)
        return
    with caplog.at_level("WARNING", logger="flashspec"):
        validate(cfg)
    said = [r.getMessage() for r in caplog.records if "uncaptured" in r.getMessage()]
    assert said == ([] if mode == "eager" else [f"runtime={mode} on hardware={hw}: no CUDA "
                                                "graphs off CUDA, so its steps run uncaptured"])


def test_runtime_keys_reach_the_engine():
    """engine_options and the draft context read the runtime group: `hardware=cpu
    runtime=resident` puts the engine on the resident loop with that runtime's chunk and kernel
    switches."""
    from experiments.harness import engine_options
    from flashspec.core import SamplingParams
    cfg = composed("runtime=resident", "runtime.resident_chunk=4",
                   "runtime.verify_backend=torch", "runtime.kernels.fuse_finish=false")
    kw = engine_options(cfg, SamplingParams(), [])
    assert kw["resident"] and kw["graphs"] and kw["chunk"] == 4
    assert kw["backend"].name == "torch"
    assert not engine_options(composed(), SamplingParams(), [])["resident"]
    assert build(cfg.runtime).kernels.fuse_finish is False


def test_every_bandit_builds_a_policy_over_the_arms():
    for option in options("bandit"):
        cfg = composed(f"bandit={option}")
        kwargs = {"means": [0.1, 0.2, 0.3]} if option == "oracle" else {}
        policy = build(cfg.bandit)(n_arms=3, seed=0, **kwargs)
        assert isinstance(policy, Policy) and policy.n_arms == 3
        assert 0 <= policy.select({"step": 0, "domain": "code", "ngram_hit": True}) < 3


def test_head_choices_and_planner():
    assert isinstance(build(composed("head=full").head), FullHeadChoice)
    low = build(composed("head=lowrank", "head.rank=d/16").head)
    assert isinstance(low, LowRankChoice) and low.rank == "d/16"
    assert isinstance(build(composed("head=truncated").head), TruncatedChoice)
    assert make_planner(composed("planner=none")) is None
    assert make_planner(composed("planner=goodput", "planner.objective=total")).objective == "total"


@pytest.mark.parametrize("overrides,needles", [
    (["head=full", "head.rank=d/8"], ["head=full", "head.rank=d/8"]),
    (["head=truncated", "head.rank=d/8"], ["head=truncated", "head.rank=d/8", "head.keep"]),
    (["head.rank=abc"], ["head.rank", "abc"]),
    (["head.rank=d/0"], ["head.rank", "d/0"]),
    (["head.init=magic"], ["head.init", "magic"]),
    (["dataset.n_prompts=0"], ["dataset.n_prompts"]),
    (["dataset.max_new_tokens=-1"], ["dataset.max_new_tokens"]),
    (["bandit=ucb1", "bandit.reward=speed"], ["bandit.reward", "speed"]),
    (["bandit=fixed", "bandit.arm=5"], ["arm=5"]),
    (["planner=goodput", "planner.objective=fastest"], ["objective"]),
])
def test_contradictions_fail_at_composition(overrides, needles):
    cfg = composed(*overrides)
    with pytest.raises(FlashSpecError) as err:
        validate(cfg, overrides)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_head_setting_no_drafter_takes_is_refused():
    """drafters=ngram has no model drafter: a head override would be a silent no-op."""
    overrides = ["drafters=ngram", "head.rank=d/16"]
    with pytest.raises(FlashSpecError, match=r"head.rank=d/16 has no effect.*ngram"):
        validate(composed(*overrides), overrides)
    validate(composed("drafters=ngram"), ["drafters=ngram"])           # the default head is fine
    validate(composed("head.rank=d/16"), ["head.rank=d/16"])           # the default drafter takes it


def test_config_arms_and_a_policy_over_them():
    cfg = composed("drafters=mixed_eagle_ngram_skip", "bandit=rate_tps")
    arms = config_arms(cfg.drafters)
    assert arms == [Arm("ngram", 3), Arm("eagle_lr72", 3), Arm("skip10", 2)]
    policy = make_policy(cfg.bandit, len(arms), 0)
    assert policy.label == "contextual[ngram_hit](rate_thompson)/tps"
    assert policy.context_keys == ("ngram_hit",)
    both = make_policy(composed("bandit=domain_match_tps").bandit, len(arms), 0)
    assert both.label == "contextual[domain+ngram_match](d_rate_thompson)/tps"
    assert both.context_keys == ("domain", "ngram_match")


def test_experiment_preset_overrides_several_groups():
    cfg = composed("experiment=mixed_stream")
    assert cfg.dataset.name == "mixed" and cfg.dataset.n_prompts == 24
    assert list(cfg.drafters.drafters) == ["ngram", "eagle_lr72", "skip10"]
    assert set(cfg.experiment.extra_bandits) == {"ngram_hit_tps", "ngram_match_tps_cold",
                                               "rate_tps", "domain_match_tps", "ucb1",
                                               "d_rate_tps", "sw_ucb_tps"}
    assert cfg.priors.use and cfg.priors.weight == 10
    # the policy warm, its cold twin beside it: one config, two labels
    arms = config_arms(cfg.drafters)
    warm = make_policy(cfg.bandit, len(arms), 0)
    assert warm.label == "contextual[ngram_match](d_rate_thompson)/tps"
    cold = make_policy(cfg.experiment.extra_bandits.ngram_match_tps_cold, len(arms), 0)
    assert (warm.cold, cold.cold) == (False, True)
    assert cold.label == warm.label + "/cold"
    assert cfg.experiment.name == "decode"
    # a command-line choice still wins over the preset's
    assert composed("experiment=mixed_stream", "dataset=gsm8k").dataset.name == "gsm8k"


def test_arm_forms_parse_to_one_value():
    """Every way a config or a record names an arm reads as the same frozen, hashable Arm, and
    its label is the record's string again (what committed records and notebooks read)."""
    from flashspec.core import TreeShape
    tree = Arm("eagle_lr72", tree=TreeShape.parse("dyn3d3k2"))
    for form in (["eagle_lr72", "dyn3d3k2"], ("eagle_lr72", TreeShape.parse("dyn3d3k2")),
                 "eagle_lr72@dyn3d3k2", tree):
        assert Arm.parse(form) == tree
    assert tree.gamma == 3 and tree.label == "eagle_lr72@dyn3d3k2" and str(tree) == tree.label
    for form in (["ngram", 3], ["ngram", 3.0], ["ngram", "3"], "ngram@3"):
        assert Arm.parse(form) == Arm("ngram", 3)
    assert Arm.parse("ar") == Arm.parse(["ar", 0]) == Arm() and Arm().label == "ar"
    assert len({Arm("ngram", 3), Arm.parse("ngram@3"), Arm(), Arm.parse("ar")}) == 2
    for label in ("ngram@3", "eagle_lr72@dyn3d3k2", "eagle_lr72@4x2x1", "ar"):
        assert Arm.parse(label).label == label
    for bad in (["ngram", 0], ["ngram", 2.5], ["ngram", True], "ngram", "@3", ["ngram"]):
        with pytest.raises(FlashSpecError):
            Arm.parse(bad)
    with pytest.raises(FlashSpecError, match="depth 3, not gamma 2"):
        Arm("eagle_lr72", 2, TreeShape.parse("dyn3d3k2"))

"""experiments/results/ holds only the records listed in its manifest, stays small, and is what
RESULTS.md and README's headline table say.

manifest.yaml maps claims to run directories (with commit and command); every listed run must
exist, every file under experiments/results/ must belong to a listed run, every claim must name
listed runs, every selector must read its value from the records, and RESULTS.md and README's
headline block must be the manifest's rendering byte for byte (scripts/results_page.py), so no
published number is typed by hand where a selector reads it.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import re
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest
import yaml

from flashspec.records import read_records

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
MANIFEST_FILES = {"manifest.yaml"}
SHA = re.compile(r"^[0-9a-f]{40}(-dirty)?$")


@pytest.fixture(scope="module")
def manifest() -> dict:
    return yaml.safe_load((RESULTS / "manifest.yaml").read_text())


def result_files() -> list[Path]:
    """Files under experiments/results/ (hidden and cache files aside), relative to it."""
    return sorted(p.relative_to(RESULTS) for p in RESULTS.rglob("*")
                  if p.is_file() and not any(part.startswith(".") or part == "__pycache__"
                                             for part in p.relative_to(RESULTS).parts))


def test_every_listed_run_exists(manifest):
    runs = [r["run"] for r in manifest["runs"]]
    assert len(runs) == len(set(runs)), "a run is listed twice"
    missing = [r for r in runs if not (RESULTS / r).is_dir()]
    assert not missing, f"listed in manifest.yaml but not under experiments/results/: {missing}"
    empty = [r for r in runs if not any(p.is_file() for p in (RESULTS / r).rglob("*"))]
    assert not empty, f"listed runs without files: {empty}"


def _owner(rel: str, runs: set[str]) -> str | None:
    """The listed run a path under experiments/results/ belongs to (its deepest listed ancestor)."""
    parts = rel.split("/")
    for n in range(len(parts), 0, -1):
        if "/".join(parts[:n]) in runs:
            return "/".join(parts[:n])
    return None


def test_nothing_unlisted(manifest):
    """Every file lies in a listed run directory (so nothing unlisted creeps in)."""
    runs = {r["run"] for r in manifest["runs"]}
    stray = [f.as_posix() for f in result_files()
             if f.as_posix() not in MANIFEST_FILES and _owner(f.parent.as_posix(), runs) is None]
    assert not stray, f"files under experiments/results/ in no listed run (add them to manifest.yaml): {stray}"
    dirs = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_dir()
            and not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(RESULTS).parts)}
    unlisted = [d for d in dirs if _owner(d, runs) is None and not any(r.startswith(d + "/") for r in runs)]
    assert not unlisted, f"directories neither in a listed run nor above one: {sorted(unlisted)}"


def test_runs_have_commit_and_command(manifest):
    """Every run names the commit its records came from and the run.py command that makes them
    (a file another listed run wrote names that run instead)."""
    names = {r["run"] for r in manifest["runs"]}
    for r in manifest["runs"]:
        assert SHA.match(r["committed_in"]), r["run"]
        assert SHA.match(r.get("provenance_commit") or ""), r["run"]
        assert r.get("source_commit") is None or SHA.match(r["source_commit"]), r["run"]
        assert "run.py" in r["command"] or any(n in r["command"] for n in names - {r["run"]}), r["run"]
        for p in r.get("lab_notebook") or []:
            assert p.startswith("experiments/results/") and not (ROOT / p).exists(), (r["run"], p)


def test_lab_notebook_holds_what_left(manifest):
    """Files a run keeps only on the history branch are there (skipped where it is not fetched)."""
    git = shutil.which("git")
    branch = manifest["history_branch"]
    if not git or subprocess.run([git, "rev-parse", "--verify", "-q", branch], cwd=ROOT,
                                 capture_output=True).returncode != 0:
        pytest.skip(f"branch {branch} not available")
    for r in manifest["runs"]:
        for p in r.get("lab_notebook") or []:
            ok = subprocess.run([git, "cat-file", "-e", f"{branch}:{p}"], cwd=ROOT, capture_output=True)
            assert ok.returncode == 0, f"{p} not on {branch}"


def test_claims_name_listed_runs(manifest):
    runs = {r["run"] for r in manifest["runs"]}
    used = set()
    for c in manifest["claims"]:
        assert c["topic"].strip() and c["claim"].strip()
        assert c["runs"] and set(c["runs"]) <= runs, c
        used.update(c["runs"])
    assert used == runs, f"runs behind no claim: {sorted(runs - used)}"


def _results_page():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "scripts" / "results_page.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_points_at_the_results_page():
    readme = (ROOT / "README.md").read_text()
    assert "RESULTS.md" in readme and "lab-notebook" in (ROOT / "RESULTS.md").read_text()


def test_results_page_is_the_rendering_of_the_manifest(manifest):
    page = _results_page()
    assert (ROOT / "RESULTS.md").read_text() == page.render(manifest), \
        "RESULTS.md is stale: python scripts/results_page.py"


def test_readme_headline_is_the_rendering_of_the_manifest(manifest):
    page = _results_page()
    readme = (ROOT / "README.md").read_text()
    assert readme == page.with_headline(readme, manifest), \
        "README.md's headline table is stale: python scripts/results_page.py"


def _selectors(manifest: dict) -> list[tuple[str, dict]]:
    out = [(f"headline {row['label']}", cell) for row in manifest["headline"]["rows"]
           for cell in row["cells"] if cell is not None]
    for c in manifest["claims"]:
        out += [(f"{c['topic']}: {name}", spec) for name, spec in (c.get("values") or {}).items()]
    return out


def _selector_runs(spec: dict) -> set[str]:
    """The run directories a selector reads (`run` one or a list; a `ratio` or `difference` its terms')."""
    if "ratio" in spec or "difference" in spec:
        return set().union(*(_selector_runs(s) for s in spec.get("ratio") or spec["difference"]))
    return set(spec["run"]) if isinstance(spec["run"], list) else {spec["run"]}


def test_every_selector_reads_its_records(manifest):
    """Each value is read from a listed run's records, one record per value where agg is one."""
    page = _results_page()
    runs = {r["run"] for r in manifest["runs"]}
    selectors = _selectors(manifest)
    assert selectors, "no selector: the headline must be read from records"
    for where, spec in selectors:
        assert _selector_runs(spec) <= runs, (where, spec)
        values = page.measure(spec)
        assert values and all(v == v for v in values), where
    for c in manifest["claims"]:
        names = set(re.findall(r"{(\w+)}", c["claim"]))
        assert names == set(c.get("values") or {}), f"{c['topic']}: placeholders {names} vs values"
        for name, spec in (c.get("values") or {}).items():
            assert _selector_runs(spec) <= set(c["runs"]), f"{c['topic']}: {name} reads a run the claim does not name"
    for row in manifest["headline"]["rows"]:
        assert row["hardware"] in manifest["hardware"] and len(row["cells"]) == len(manifest["headline"]["columns"])
    assert {c["hardware"] for c in manifest["claims"]} <= set(manifest["hardware"])
    assert {c["section"] for c in manifest["claims"]} <= {s["id"] for s in manifest["sections"]}


def test_a_selector_is_the_record_value(manifest):
    """A headline figure is the record's own value, and a changed record changes the rendering."""
    page = _results_page()
    spec = {"run": "decode_cpu/main_job_v4", "file": "job_metrics.json", "field": "ar/tps", "digits": 2}
    metrics = json.loads((RESULTS / "decode_cpu/main_job_v4/job_metrics.json").read_text())
    assert page.value_text(spec) == f"{metrics['ar/tps']:.2f}"
    with pytest.raises(page.SelectorError):
        page.measure({**spec, "field": "ar/no_such_metric"})
    rows = list(read_records(RESULTS / "bench_h200_s6151/greedy_he/records.jsonl.gz"))
    pid = rows[0]["prompt_id"]
    tps = {r["method"]: r["tps"] for r in rows if r["prompt_id"] == pid}
    ratio = {"run": "bench_h200_s6151", "file": "greedy_he/records.jsonl.gz", "where": {"prompt_id": pid,
             "method": "tree"}, "field": "tps", "over": {"method": "ar"}, "pair": ["prompt_id", "turn"]}
    assert page.measure(ratio) == [tps["tree"] / tps["ar"]]
    with pytest.raises(page.SelectorError):   # every prompt's tree record: agg one wants one
        page.measure({**ratio, "where": {"method": "tree"}})


def test_figures_exist(manifest):
    sections = {s["id"] for s in manifest["sections"]}
    for f in manifest.get("figures") or []:
        assert f["section"] in sections and (RESULTS / f["path"]).is_file(), f


def test_tracked_size_under_the_bar(manifest):
    """git's tracked files when in a checkout (what the bar is about), else what is on disk."""
    files = None
    if shutil.which("git") and (ROOT / ".git").exists():
        proc = subprocess.run(["git", "ls-files", "-z", "--", "experiments/results"], cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode == 0:
            files = [ROOT / f for f in proc.stdout.split("\0") if f]
    if files is None:
        files = [RESULTS / f for f in result_files()]
    size = sum(f.stat().st_size for f in files if f.is_file())
    assert size < manifest["max_tracked_bytes"] <= 5_000_000, f"experiments/results/ tracks {size} bytes"
    on_disk = sum((RESULTS / f).stat().st_size for f in result_files())
    assert on_disk < manifest["max_tracked_bytes"], f"experiments/results/ holds {on_disk} bytes on disk"


@pytest.fixture
def copied_page(tmp_path, monkeypatch):
    """The results page reading a scratch copy of experiments/results/, so a test can change a record."""
    page = _results_page()
    root = tmp_path / "repo"
    shutil.copytree(RESULTS, root / "experiments" / "results",
                    ignore=shutil.ignore_patterns("*.png", "*.parquet"))
    monkeypatch.setattr(page, "ROOT", root)
    monkeypatch.setattr(page, "RESULTS", root / "experiments" / "results")
    return page, root / "experiments" / "results"


def test_a_printed_table_and_a_pattern_are_read_as_records(copied_page):
    """summary.txt's rows are records keyed by its header; a pattern reads what a run only printed."""
    page, results = copied_page
    summary = results / "decode_cpu/default_eagle_lr72_g3/summary.txt"
    row = next(line.split() for line in summary.read_text().splitlines()
               if line.split()[:2] == ["mtbench", "spec:eagle_lr72@3"])
    spec = {"run": "decode_cpu/default_eagle_lr72_g3", "file": "summary.txt",
            "where": {"dataset": "mtbench", "method": "spec:eagle_lr72@3"}, "field": "tau"}
    assert page.measure(spec) == [float(row[5])]
    mean = {"run": "decode_cpu/default_eagle_lr72_g3", "file": "summary.txt", "where": {"method": "ar"},
            "field": "tps", "agg": "mean"}
    ar = [float(line.split()[6]) for line in summary.read_text().splitlines() if line.split()[1:2] == ["ar"]]
    assert len(ar) == 3 and page.measure(mean) == [pytest.approx(sum(ar) / 3)]
    summary.write_text(summary.read_text().replace(f" {row[5]} ", " 9.999 ", 1))
    assert page.measure(spec) == [9.999]
    summary.write_text("\n".join(line for line in summary.read_text().splitlines() if "mtbench" not in line))
    with pytest.raises(page.SelectorError):
        page.measure(spec)

    mixed = results / "mixed_stream_cpu_v10/s701/summary.txt"
    pattern = {"run": "mixed_stream_cpu_v10/s701", "file": "summary.txt", "pattern": r"mean of fixed arms: ([\d.]+)"}
    assert page.measure(pattern) == [float(re.search(r"mean of fixed arms: ([\d.]+)", mixed.read_text())[1])]
    mixed.write_text(mixed.read_text().replace("mean of fixed arms: ", "mean of fixed arms: 7"))
    assert page.measure(pattern)[0] > 7
    mixed.write_text(mixed.read_text().replace("mean of fixed arms", "mean of the fixed arms"))
    with pytest.raises(page.SelectorError):
        page.measure(pattern)


def test_a_median_over_prompts_pairs_each_prompt_with_its_own_ar(copied_page):
    """`pair` divides each prompt's tok/s by the same prompt's AR; `ratio` divides two pooled values."""
    page, results = copied_page
    path = results / "bench_h100_bandit_s9907/s9907/greedy_he/records.jsonl.gz"
    rows = list(read_records(path))
    ar = {r["prompt_id"]: r["tps"] for r in rows if r["method"] == "ar"}
    speedups = [r["tps"] / ar[r["prompt_id"]] for r in rows if r["method"] == "tree"]
    spec = {"run": "bench_h100_bandit_s9907", "file": "s9907/greedy_he/records.jsonl.gz",
            "where": {"method": "tree"}, "field": "tps", "over": {"method": "ar"},
            "pair": ["prompt_id", "turn"], "agg": "median"}
    assert len(speedups) == 24 and page.measure(spec) == [pytest.approx(statistics.median(speedups))]
    with pytest.raises(page.SelectorError):   # without the pair, 24 AR records divide each value
        page.measure({**spec, "pair": []})
    pooled = {"run": "bench_h100_bandit_s9907", "file": "s9907/greedy_he/records.jsonl.gz",
              "field": ["n_new_tokens", "wall_s"], "agg": "pooled"}

    def tps(method: str) -> float:
        mine = [r for r in rows if r["method"] == method]
        return sum(r["n_new_tokens"] for r in mine) / sum(r["wall_s"] for r in mine)
    ratio = {"ratio": [{**pooled, "where": {"method": "tree"}}, {**pooled, "where": {"method": "chain_g4"}}]}
    assert page.measure(ratio) == [pytest.approx(tps("tree") / tps("chain_g4"))]
    difference = {"difference": ratio["ratio"], "scale": 2}
    assert page.measure(difference) == [pytest.approx(2 * (tps("tree") - tps("chain_g4")))]
    first = next(r for r in rows if r["method"] == "ar")
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows if r is not first) + "\n")
    with pytest.raises(page.SelectorError):   # a prompt whose AR record is gone has nothing to divide by
        page.measure(spec)


def test_nested_fields_several_runs_scale_offset_and_absent_fields(copied_page):
    page, results = copied_page
    kernels = results / "bench_h100_s9473/kernel_bench/kernel_bench.jsonl"
    timing = {"run": "bench_h100_s9473", "file": "kernel_bench/kernel_bench.jsonl",
              "where": {"B": 64, "gamma": 4, "V": 128256}, "field": "plan.chunk", "scale": 1000, "offset": 1}
    shape = next(r for r in map(json.loads, kernels.read_text().splitlines())
                 if (r["B"], r["gamma"], r["V"]) == (64, 4, 128256))
    assert page.measure(timing) == [shape["plan"]["chunk"] * 1000 + 1]
    with pytest.raises(page.SelectorError):
        page.measure({**timing, "field": "plan.no_such_key"})
    repeats = {"run": ["bench_h200_s6151", "bench_h100_s9473"], "file": "greedy_he/job_metrics.json",
               "field": "tree/speedup_pooled", "agg": "range"}
    assert len(page.measure(repeats)) == 2
    with pytest.raises(page.SelectorError):   # two runs, one value each: agg one wants one
        page.measure({**repeats, "agg": "one"})
    groups = {"run": "bench_h200_s6151", "file": "greedy_mt/records.jsonl.gz", "agg": "range", "field": "accept_hist",
              "where": {"method": "tree_planner"}}
    record = next(r for r in read_records(results / "bench_h200_s6151/greedy_mt/records.jsonl.gz")
                  if r["method"] == "tree_planner")
    groups["where"]["prompt_id"] = record["prompt_id"]
    assert page.measure(groups) == [float(v) for v in record["accept_hist"]]   # a list field: one value each
    bare = {"run": "bench_h100_s9473", "file": "kernel_bench/kernel_bench.jsonl", "where": {"provenance": None},
            "field": "floor_us", "agg": "range"}
    n_rows = len(kernels.read_text().splitlines())
    assert len(page.measure(bare)) == n_rows - 1   # every row but the first, which keeps the provenance
    error = {"run": "head_decode_v2", "file": "*/head_summary.jsonl", "where": {"variant": ["trained_d8", "trunc_d8"]},
             "field": ["rho_tps_pred", "rho_tps_meas"], "scale": 100, "offset": -100, "abs": True, "agg": "max"}
    heads = [json.loads(line) for f in sorted(results.glob("head_decode_v2/*/head_summary.jsonl"))
             for line in f.read_text().splitlines()]
    worst = max(abs(r["rho_tps_pred"] / r["rho_tps_meas"] - 1) * 100 for r in heads if r["variant"] in ("trained_d8", "trunc_d8"))
    assert page.measure(error) == [pytest.approx(worst)]
    assert page.measure({**error, "abs": False, "agg": "min"})[0] < 0 < worst   # abs is what made it a size
    either = {"run": "bench_h100_s9473", "file": "hf_he/records.jsonl.gz", "field": "tps", "agg": "range",
              "where": {"method": ["ar", "hf_compiled"]}}
    rows = list(read_records(results / "bench_h100_s9473/hf_he/records.jsonl.gz"))
    assert sorted(page.measure(either)) == sorted(r["tps"] for r in rows if r["method"] in ("ar", "hf_compiled"))


def test_pack_run_keeps_what_claims_read_and_drops_the_rest(tmp_path):
    """scripts/pack_run.py: records lose text, rewards and provenance, tokens become a digest that
    matches where outputs match; the summary is the printed tables without log prefixes."""
    import sys
    job = tmp_path / "job"
    job.mkdir()
    prov = {"commit": "abc", "hardware": {"cpu_count": 2}}
    rows = [{"experiment": "decode", "method": m, "dataset": "mtbench", "prompt_id": "mtbench/1",
             "turn": 0, "n_new_tokens": 3, "wall_s": 0.5, "tokens": toks, "text": "hi",
             "rewards": [1.0], "provenance": prov}
            for m, toks in (("ar", [1, 2, 3]), ("spec:x@3", [1, 2, 3]), ("spec:y@3", [1, 2, 4]))]
    (job / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (job / "run.log").write_text("[2026-12-07 01:00:00,000][x][INFO] - records: r.jsonl\n"
                                 "dataset  method  tps\n-------  ------  ---\n"
                                 "[2026-12-07 01:00:01,000][x][INFO] - pooled tok/s over the run\n")
    (job / "job_metrics.json").write_text("{}")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "pack_run.py"), str(job),
                    str(tmp_path / "out")], check=True, capture_output=True)
    packed = list(read_records(tmp_path / "out" / "records.jsonl.gz"))
    assert [r["method"] for r in packed] == ["ar", "spec:x@3", "spec:y@3"]
    assert not any({"text", "rewards", "provenance", "tokens"} & set(r) for r in packed)
    digests = [r["tokens_sha256"] for r in packed]
    assert digests[0] == digests[1] != digests[2]
    assert json.loads((tmp_path / "out" / "provenance.json").read_text()) == prov
    assert (tmp_path / "out" / "summary.txt").read_text() == (
        "dataset  method  tps\n-------  ------  ---\npooled tok/s over the run\n")
    rows[1]["arms"] = [2, 0, 2, 2]
    (job / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "pack_run.py"), "--no-steps", str(job),
                    str(tmp_path / "slim")], check=True, capture_output=True)
    slim = list(read_records(tmp_path / "slim" / "records.jsonl.gz"))
    assert slim[1]["arm_counts"] == {"0": 1, "2": 3} and "arms" not in slim[1]

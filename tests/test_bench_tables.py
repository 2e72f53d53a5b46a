"""Benchmark results as data: the index built from result files, the generated tables, and --check against the repo
(so a hand edit of a generated number, or a result file that was never indexed, fails CI)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchlib.index import build_index, reconstructed_command
from benchlib.tables import NOT_MEASURED, StaleOrBroken, regenerate
from script_modules import script_module

REPO = Path(__file__).resolve().parents[1]


def _result(config, tokens, peak=10.0, ratio=None, status="ok", **extra):
    out = {"config": config, "status": status, "tokens_per_s": tokens, "peak_gib": peak, **extra}
    if ratio is not None:
        out["ratio_to_best_stock"] = ratio
    return out


def _record(workload, date, results, **extra):
    args = {"workload": workload, "configs": str([r["config"] for r in results]), "steps": "30", "warmup": "6",
            "out": "/somewhere/out", "best_compile": "on", "tiny": "False", "best_checkpointing": "None"}
    return {"workload": workload, "tiny": False, "device": "cuda", "date": date, "versions": {"gpu": "GPU-X"},
            "args": args, "results": results, **extra}


def _write(results_dir: Path, name: str, record) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / name).write_text(json.dumps(record))


DOC = """# doc
<!-- bench:table workload=w1 -->
<!-- /bench:table -->
text kept
<!-- bench:summary -->
<!-- /bench:summary -->
"""


@pytest.fixture
def tree(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    _write(results, "w1_old.json", _record("w1", "2026-01-01T10:00:00", [
        _result("trl-fa4-packed", 100.0, ratio=1.0), _result("hf_accel-best", 150.0, ratio=1.5)]))
    _write(results, "w1_new.json", _record("w1", "2026-01-02T10:00:00+00:00", [
        _result("trl-fa4-packed", 110.0, 20.0, ratio=1.0), _result("hf_accel-best", 160.0, 12.5, ratio=160 / 110)],
        command="python scripts/bench.py --preset w1"))
    # newer, but no stock anchor ran in it: not a same-run comparison, so not current
    _write(results, "w1_newest.json", _record("w1", "2026-01-03T10:00:00+00:00", [_result("hf_accel-best", 999.0)]))
    # newer, with an anchor, but every hf_accel row failed (a call out of time): nothing to compare, so not current
    _write(results, "w1_partial.json", _record("w1", "2026-01-03T11:00:00+00:00", [
        _result("trl-fa4-packed", 105.0, ratio=1.0), _result("hf_accel-best", None, status="skipped: time budget")]))
    # newer, with an anchor, but only side configurations (no defaults / best row): the headline run stays current
    _write(results, "w1_side.json", _record("w1", "2026-01-03T12:00:00+00:00", [
        _result("trl-fa4-packed", 105.0, ratio=1.0), _result("hf_accel-offload", 120.0, ratio=120 / 105)]))
    _write(results, "w1-tiny.json", {**_record("w1", "2026-01-04T10:00:00", [_result("trl-fa4-packed", 1.0)]),
                                     "tiny": True})
    _write(results, "profile_w1.json", {"workload": "w1", "steady_step_s": 0.2})  # not a bench.py record
    (tmp_path / "README.md").write_text(DOC)
    (tmp_path / "BENCHMARKS.md").write_text(DOC.replace("summary", "runs"))
    return tmp_path


def test_index_current_run_and_fields(tree):
    index = build_index(tree / "benchmarks" / "results")
    runs = {r["file"]: r for r in index["runs"]}
    # tiny and profile files left out
    assert set(runs) == {"w1_old.json", "w1_new.json", "w1_newest.json", "w1_partial.json", "w1_side.json"}
    assert [r["file"] for r in index["runs"]] == ["w1_old.json", "w1_new.json", "w1_newest.json", "w1_partial.json",
                                                  "w1_side.json"]
    assert [r["file"] for r in index["runs"] if r["current"]] == ["w1_new.json"]
    assert runs["w1_new.json"]["command"] == "python scripts/bench.py --preset w1"
    assert runs["w1_old.json"]["command_source"].startswith("reconstructed")
    assert [(c["config"], c["role"]) for c in runs["w1_new.json"]["configs"]] == [
        ("trl-fa4-packed", "stock"), ("hf_accel-best", "best")]


def test_a_run_with_both_headline_rows_stays_current_over_a_later_one_with_one(tmp_path):
    """A later same-run comparison of the stock anchor and hf_accel's defaults alone (a side measurement) does not
    displace the last run that measured the defaults and the best settings: the tables show both rows."""
    results = tmp_path / "results"
    _write(results, "w1_full.json", _record("w1", "2026-01-02T10:00:00+00:00", [
        _result("trl-fa4-packed", 100.0, ratio=1.0), _result("hf_accel-defaults", 130.0, ratio=1.3),
        _result("hf_accel-best", 150.0, ratio=1.5)]))
    _write(results, "w1_defaults.json", _record("w1", "2026-01-03T10:00:00+00:00", [
        _result("trl-fa4-packed", 100.0, ratio=1.0), _result("hf_accel-defaults", 131.0, ratio=1.31)]))
    assert [r["file"] for r in build_index(results)["runs"] if r["current"]] == ["w1_full.json"]
    # without a run of both, the newest run with either headline row is current
    (results / "w1_full.json").unlink()
    assert [r["file"] for r in build_index(results)["runs"] if r["current"]] == ["w1_defaults.json"]


def test_reconstructed_command_keeps_what_changes_the_run_and_drops_paths():
    args = {"workload": "llama-1b", "configs": "['a', 'b']", "steps": "30", "warmup": "6", "out": "/x/out",
            "fused_ce": "auto", "best_checkpointing": "budget:0.8", "best_compile": "on", "seed": "0"}
    assert reconstructed_command(args) == ("python scripts/bench.py --workload llama-1b --configs a,b --steps 30 "
                                           "--warmup 6 --best-checkpointing budget:0.8 --best-compile on")


def test_regions_render_current_run_and_say_what_was_not_measured(tree):
    index = build_index(tree / "benchmarks" / "results")
    text = regenerate(DOC, index)
    table = text.split("<!-- bench:table workload=w1 -->")[1].split("<!-- /bench:table -->")[0]
    assert "w1_new.json" in table and "GPU-X" in table and "2026-01-02 10:00 UTC" in table
    assert "`python scripts/bench.py --preset w1`" in table
    assert "| 160 | - | 1.45x | 12.5 |" in table  # best row of the current run, not the newer anchor-less one
    assert f"| hf_accel defaults | `hf_accel.patch(model)`, no arguments (`hf_accel-defaults`) | {NOT_MEASURED} |" \
        in table
    assert "text kept" in text
    summary = text.split("<!-- bench:summary -->")[1]
    assert "TRL SFTTrainer packing + flash-attn-4: 0.1k, 20.0 GiB" in summary and NOT_MEASURED in summary
    assert regenerate(text, index) == text  # idempotent


@pytest.mark.parametrize("doc, words", [
    ("<!-- bench:table workload=w1 -->\nno end\n", "closed regions"),
    ("<!-- bench:nope -->\n<!-- /bench:nope -->\n", "unknown region kind"),
    ("<!-- bench:table -->\n<!-- /bench:table -->\n", "workload=NAME"),
])
def test_broken_regions_raise(tree, doc, words):
    with pytest.raises(StaleOrBroken, match=words):
        regenerate(doc, build_index(tree / "benchmarks" / "results"))


def test_check_fails_on_hand_edits_and_unindexed_results_until_regenerated(tree, capsys):
    main = script_module("bench_tables").main
    assert main(["--check", "--root", str(tree)]) == 1  # nothing generated yet
    assert main(["--root", str(tree)]) == 0
    assert main(["--check", "--root", str(tree)]) == 0
    readme = tree / "README.md"
    generated = readme.read_text()
    readme.write_text(generated.replace("0.2k", "0.3k"))  # a hand edit of a generated number
    assert main(["--check", "--root", str(tree)]) == 1
    assert "README.md" in capsys.readouterr().err
    assert main(["--root", str(tree)]) == 0 and readme.read_text() == generated
    _write(tree / "benchmarks" / "results", "w1_later.json", _record("w1", "2026-01-05T10:00:00+00:00", [
        _result("trl-fa4-packed", 120.0, ratio=1.0)]))
    assert main(["--check", "--root", str(tree)]) == 1  # a new result file makes the index and tables stale


@pytest.mark.slow
def test_repo_generated_tables_are_current():
    """BENCHMARKS.md, README.md and benchmarks/index.json match benchmarks/results/ (regenerate, never hand-edit)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_tables.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_chart_written(tree):
    pytest.importorskip("matplotlib")
    assert script_module("bench_tables").main(["--chart", "--root", str(tree)]) == 0
    assert (tree / "benchmarks" / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repo_copy_check_catches_an_edited_readme_number(tmp_path):
    """The same guard on the real files: change one digit inside README's generated table."""
    shutil.copytree(REPO / "benchmarks", tmp_path / "benchmarks", ignore=shutil.ignore_patterns("*.md", "*.png"))
    for name in ("README.md", "BENCHMARKS.md"):
        shutil.copy(REPO / name, tmp_path / name)
    readme = (tmp_path / "README.md").read_text()
    region = readme.split("<!-- bench:summary -->")[1].split("<!-- /bench:summary -->")[0]
    digit = next(i for i, ch in enumerate(region) if ch.isdigit() and region[i - 1] == " ")
    edited = region[:digit] + str((int(region[digit]) + 1) % 10) + region[digit + 1:]
    (tmp_path / "README.md").write_text(readme.replace(region, edited))
    assert script_module("bench_tables").main(["--check", "--root", str(tmp_path)]) == 1


def test_multi_gpu_region_renders_the_newest_nproc_run_and_its_scaling(tree):
    results = tree / "benchmarks" / "results"
    rows = [_result("trl-fa4-packed-liger", 100.0, nproc=1, steady_tokens_per_s=100.0),
            _result("hf_accel-defaults", 120.0, nproc=1, steady_tokens_per_s=120.0),
            _result("trl-fa4-packed-liger", 190.0, nproc=2, steady_tokens_per_s=190.0),
            _result("hf_accel-defaults", 236.0, nproc=2, steady_tokens_per_s=236.0)]
    _write(results, "w1-nproc1-2.json", {**_record("w1", "2026-01-05T10:00:00+00:00", rows), "nproc": [1, 2]})
    index = build_index(results)
    doc = "<!-- bench:multi workload=w1 -->\n<!-- /bench:multi -->\n"
    text = regenerate(doc, index)
    assert "w1-nproc1-2.json" in text and "| `hf_accel-defaults` | 2 | 236 | 236 |" in text
    assert "| hf_accel-defaults | 120 | 236 | 1.97 | 1.20 | 1.24 |" in text  # scaling 236/120, vs TRL 120/100, 236/190
    assert "| trl-fa4-packed-liger | 100 | 190 | 1.90 | - | - |" in text
    # the multi-GPU run never becomes a workload's current single-GPU run
    assert "w1-nproc1-2.json" not in regenerate(DOC, index).split("<!-- bench:table workload=w1 -->")[1]
    assert "No multi-GPU run" in regenerate(doc.replace("w1", "w2"), index)


def test_runs_log_names_each_long_context_rows_length(tmp_path):
    from benchlib.tables import runs_log

    _write(tmp_path, "long.json", _record("w-long", "2026-01-05T10:00:00+00:00", [
        _result("hf_accel-best", 2882.0, 42.7, doc_length=131072), _result("hf_accel-best", 1609.0, 41.9,
                                                                           doc_length=262144)]))
    log = runs_log(build_index(tmp_path))
    assert "hf_accel-best @ 131,072 tokens 2,882 (42.7); hf_accel-best @ 262,144 tokens 1,609 (41.9)" in log


def test_runs_log_marks_rows_measured_with_an_older_definition_of_their_configuration(tmp_path):
    """Issue 70: a record made before an anchor's (or the QLoRA headline row's) definition changed keeps its numbers
    in the log, marked, with what that row measured then; the same configuration in a record made since, and a
    configuration whose definition did not change for that workload (TRL on full fine-tuning), is not marked."""
    from benchlib.anchors import ANCHOR_REVISION, REDEFINED
    from benchlib.tables import runs_log

    qlora = [_result("trl-qlora", 7236.0, 21.3), _result("unsloth-qlora", 6124.0, 15.0),
             _result("hf_accel-qlora", 11950.0, 15.0)]
    _write(tmp_path, "q_old.json", _record("llama-8b-qlora", "2026-12-05T02:27:00+00:00", qlora))
    _write(tmp_path, "q_new.json", _record("llama-8b-qlora", "2026-12-08T02:27:00+00:00", qlora,
                                           anchor_revision=ANCHOR_REVISION))
    _write(tmp_path, "full.json", _record("llama-1b", "2026-12-06T02:27:00+00:00", [
        _result("trl-fa4-packed-liger", 62498.0, 27.5), _result("hf_accel-defaults", 70374.0, 26.7)]))
    _write(tmp_path, "lora.json", _record("llama-8b-lora", "2026-12-06T04:46:00+00:00", [
        _result("trl-fa4-packed", 7223.0, 24.8), _result("hf_accel-defaults", 11965.0, 23.8)]))
    log = runs_log(build_index(tmp_path))
    rows = {line.split("[`")[1].split("`]")[0]: line for line in log.splitlines() if "[`" in line}
    assert "trl-qlora *[older anchor]* 7,236 (21.3); unsloth-qlora 6,124 (15.0); hf_accel-qlora " \
           "*[PEFT-prepared base]* 11,950 (15.0)" in rows["q_old.json"]
    assert "*[" not in rows["q_new.json"] and "*[" not in rows["full.json"]
    assert "trl-fa4-packed *[older anchor]* 7,223 (24.8); hf_accel-defaults 11,965" in rows["lora.json"]
    legend = log.split("| date |")[0]
    for name in ("trl-qlora", "hf_accel-qlora", "trl-fa4-packed"):
        assert f"`{name}` *[{REDEFINED[name].tag}]*" in legend and REDEFINED[name].before in legend
    assert "trl-fa4-packed-liger" not in legend  # no marked row of it in this log
    _write(tmp_path, "q_old.json", _record("llama-8b-qlora", "2026-12-05T02:27:00+00:00", qlora,
                                           anchor_revision=ANCHOR_REVISION))
    (tmp_path / "lora.json").unlink()
    assert "*[" not in runs_log(build_index(tmp_path))  # nothing marked, no legend


def test_long_context_region_takes_each_config_from_its_newest_run(tmp_path):
    from benchlib.tables import long_context_region

    _write(tmp_path, "l1.json", _record("w-long", "2026-01-05T10:00:00+00:00", [
        _result("trl", 100.0, 40.0, doc_length=64), _result("trl", None, status="OOM", doc_length=128),
        _result("hf_accel-best", 50.0, 30.0, doc_length=64)]))
    _write(tmp_path, "l2.json", _record("w-long", "2026-01-06T10:00:00+00:00", [
        _result("hf_accel-best", 90.0, 20.0, doc_length=64, mfu=0.4), _result("hf_accel-best", 45.0, 21.0,
                                                                              doc_length=128)]))
    region = long_context_region(build_index(tmp_path), "w-long")
    assert region.startswith("From 2 runs:") and "l1.json" in region and "l2.json" in region
    assert "| `trl` | 100 tokens/s, - MFU, 40.0 GiB | OOM | 64 |" in region
    # the newer run's rows, not the older 50 tokens/s
    assert "| `hf_accel-best` | 90 tokens/s, 40.0% MFU, 20.0 GiB | 45 tokens/s, - MFU, 21.0 GiB | 128 |" in region


def test_long_context_cell_a_later_run_had_no_time_for_keeps_its_earlier_result(tmp_path):
    """2026-11-30: a sweep whose time ran out before hf_accel's 128k row would have hidden the 256k measured earlier."""
    from benchlib.tables import long_context_region

    _write(tmp_path, "l1.json", _record("w-long", "2026-01-05T10:00:00+00:00", [
        _result("hf_accel-best", 30.0, 42.0, doc_length=128), _result("hf_accel-best", 16.0, 41.0, doc_length=256)]))
    _write(tmp_path, "l2.json", _record("w-long", "2026-01-06T10:00:00+00:00", [
        _result("trl", 100.0, 30.0, doc_length=64), _result("trl", None, status="OOM", doc_length=128),
        _result("trl", None, status="skipped: OOM at a shorter length", doc_length=256),
        _result("hf_accel-best", 90.0, 20.0, doc_length=64),
        _result("hf_accel-best", None, status="skipped: time budget exhausted (540s)", doc_length=128)]))
    index = build_index(tmp_path)
    region = long_context_region(index, "w-long")
    assert region.startswith("From 2 runs:")
    assert ("| `hf_accel-best` | 90 tokens/s, - MFU, 20.0 GiB | 30 tokens/s, - MFU, 42.0 GiB (2026-01-05 10:00 UTC run)"
            " | 16 tokens/s, - MFU, 41.0 GiB (2026-01-05 10:00 UTC run) | 256 |") in region
    assert "| `trl` | 100 tokens/s, - MFU, 30.0 GiB | OOM | skipped: OOM at a shorter length | 64 |" in region
    # a newer attempt replaces an older result, also when it failed
    _write(tmp_path, "l3.json", _record("w-long", "2026-01-07T10:00:00+00:00", [
        _result("hf_accel-best", None, status="OOM", doc_length=256)]))
    assert "| OOM | 128 |" in long_context_region(build_index(tmp_path), "w-long")
    # long-context runs have their own table: never a workload's current (headline) run
    assert not any(run.get("current") for run in index["runs"])


def test_long_context_cells_name_the_host_peak_of_offloaded_rows_and_a_host_kill(tmp_path):
    """Run 36 (issue 40b): a row whose plan put layer inputs in host memory shows its host peak beside the device's;
    a process the kernel killed with the host out of memory says so, not a status cut at 60 characters."""
    from benchlib.tables import long_context_region

    killed = ("error: killed (SIGKILL, no Python error: the kernel's OOM killer if the host ran out) at 122.4 GiB "
              "resident, 0.4 GiB of the host left")
    _write(tmp_path, "l1.json", _record("w-long", "2026-01-05T10:00:00+00:00", [
        _result("hf_accel-best", 30.0, 42.0, doc_length=128),
        _result("hf_accel-best", 9.0, 114.0, doc_length=512, host_peak_gib=97.9, offloaded_host_peak_gib=96.0),
        _result("unsloth", 28.0, 50.0, doc_length=128),
        _result("unsloth", None, status=killed, doc_length=512, host_rss_peak_gib=122.41,
                host_available_min_gib=0.41)]))
    region = long_context_region(build_index(tmp_path), "w-long")
    assert "| 9 tokens/s, - MFU, 114.0 GiB (host 97.9) | 512 |" in region
    assert "| 30 tokens/s, - MFU, 42.0 GiB | 9 tokens/s" in region  # nothing offloaded: no host figure
    assert "| host out of memory (killed at 122.4 GiB resident) | 128 |" in region


def test_a_timeout_the_time_budget_shortened_reads_as_skipped_not_failed(tmp_path):
    """Records written before bench.py told the two apart (2026-11-30 16:10: Unsloth's 128k started with 123 s of the
    budget left, was cut, and was recorded as "error: timeout after 123s" with --config-timeout 400): the index reads a
    timeout shorter than the run's --config-timeout as the budget's cut, so an earlier result of that length stays and
    the cell is no failure; a timeout at the full --config-timeout stays an error."""
    from benchlib.tables import long_context_region

    _write(tmp_path, "l1.json", _record("w-long", "2026-01-05T10:00:00+00:00", [
        _result("unsloth", 30.0, 40.0, doc_length=128)]))
    cut = _record("w-long", "2026-01-06T10:00:00+00:00", [
        _result("unsloth", 90.0, 20.0, doc_length=64),
        _result("unsloth", None, status="error: timeout after 123s", doc_length=128),
        _result("unsloth", None, status="skipped: failed at a shorter length", doc_length=256),
        _result("trl", 95.0, 20.0, doc_length=64),
        _result("trl", None, status="error: timeout after 400s", doc_length=128)])
    cut["args"]["config_timeout"] = "400"
    _write(tmp_path, "l2.json", cut)
    index = build_index(tmp_path)
    statuses = {(r["config"], r.get("doc_length")): r["status"] for run in index["runs"] for r in run["configs"]}
    assert statuses[("unsloth", 128)] == "skipped: time budget exhausted after 123s"
    assert statuses[("unsloth", 256)] == "skipped: time budget exhausted"  # not a failure either
    assert statuses[("trl", 128)] == "error: timeout after 400s"
    region = long_context_region(index, "w-long")
    assert ("| `unsloth` | 90 tokens/s, - MFU, 20.0 GiB | 30 tokens/s, - MFU, 40.0 GiB (2026-01-05 10:00 UTC run) | "
            "skipped: time budget exhausted | 128 |") in region
    assert "| `trl` | 95 tokens/s, - MFU, 20.0 GiB | error: timeout after 400s | not run | 64 |" in region


def test_a_document_in_benchmarks_links_result_files_relative_to_itself(tree):
    """benchmarks/HISTORY.md's generated runs log links `results/NAME.json`, which resolves from benchmarks/ (the
    repository-root form `benchmarks/results/NAME.json` would not)."""
    history = tree / "benchmarks" / "HISTORY.md"
    history.write_text("# history\n<!-- bench:runs -->\n<!-- /bench:runs -->\n[index](index.json)\n")
    main = script_module("bench_tables").main
    assert main(["--root", str(tree)]) == 0
    text = history.read_text()
    assert "](results/w1_new.json)" in text and "](benchmarks/" not in text and "[index](index.json)" in text
    assert (history.parent / "results" / "w1_new.json").exists()
    assert "](benchmarks/results/w1_new.json)" in (tree / "BENCHMARKS.md").read_text()  # root documents keep theirs
    assert main(["--check", "--root", str(tree)]) == 0  # stable: regenerating writes the same text

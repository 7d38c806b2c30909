"""The README's main job: `tdeploy run examples/local.yaml` runs every step of deploy-training and passes,
and a second run in the same folder passes too: its training resumes, its acceptance starts afresh.

The two runs are also the suite's clean acceptance runs in a row, and the first is its every-drill run, on the embedded
default (dropout and gradient accumulation on, as users turn them on): every dimension passes with the
correctness pair close to the independent reference, the first run records the quality baseline the second
is held to, and every drill recovers with its state matching the uninterrupted run (kill_during_save at
every phase of the save protocol). The tiny-spec
integration tests inject the faults each of these must catch; they do not repeat the clean runs.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
import yaml

from tasks.capacity.record import read_plan
from tasks.nodes.report import NodeReport
from tests.conftest import REPO
from tests.processes import run_group
from training.checkpoint import COMMIT, DCP_METADATA, TRAIN_STATE, rng_file
from training.drill_points import SAVE_PHASES

pytestmark = pytest.mark.e2e

DRILLS = {"rank_kill", "kill_during_save", "corrupt_checkpoint", "reshard", "storage_outage", "preemption",
          "replica_loss", "spare_takeover", "memory_restore", "hang", "workload_error", "bad_node_recurrence"}


def _tdeploy_run(tmp_path: Path, env: dict[str, str], spec: Path = REPO / "examples" / "local.yaml") -> None:
    tdeploy = shutil.which("tdeploy", path=str(Path(sys.executable).parent))
    proc = run_group([tdeploy, "run", str(spec)], timeout=2400, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "deploy-training local: succeeded" in proc.stdout
    # the end of the run names the one folder every report is in, and how to open the run in Prefect's UI
    assert f"reports: {(tmp_path / 'runs' / 'local').resolve()} (summary.json, summary.md)" in proc.stdout
    assert "/runs/flow-run/" in proc.stdout
    summary = json.loads((tmp_path / "runs" / "local" / "summary.json").read_text())
    assert summary["failed_step"] is None, summary


def _latest_acceptance(runs: Path, quality_rule: str, drills: bool) -> Path:
    """The latest run workspace's reports: acceptance passed every dimension, every drill recovered."""
    root = Path(json.loads((runs / "acceptance" / "latest.json").read_text())["root"])
    acceptance = json.loads((root / "acceptance.json").read_text())
    assert acceptance["verdict"] == "passed" and len(acceptance["dimensions"]) == 7, acceptance  # six and regression
    dimensions = {d["name"]: d for d in acceptance["dimensions"]}
    assert all(d["passed"] for d in dimensions.values()), dimensions
    correctness = dimensions["correctness"]["measured"]
    tolerance = dimensions["correctness"]["threshold"]["max_rel_deviation"]  # from this job's measured noise
    assert correctness["max_rel_deviation"] < tolerance / 10, correctness  # no false alarm near the tolerance
    assert correctness["quality"]["rule"] == quality_rule, correctness["quality"]
    assert "correctness" in acceptance["runs"]  # dropout on: the comparison ran a distributed job of its own
    performance = dimensions["performance"]["measured"]
    assert performance["scaling_efficiency"] > 0 and performance["slow_rank"] is None, performance
    (kill,) = acceptance["drills"]
    assert kill["name"] == "rank_kill" and kill["passed"] and kill["state_matched"] and kill["recovery_s"] > 0
    suite = ET.parse(root / "junit.xml").getroot()
    assert suite.get("tests") == "8" and suite.get("failures") == "0"  # 7 dimensions and rank_kill
    assert (root / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    if drills:
        _every_drill_recovered(json.loads((root / "drills" / "acceptance.json").read_text())["drills"])
    return root


def _served(runs: Path) -> None:
    """The serving check exported the accepted checkpoint, served it with vLLM, load-tested it, matched our
    greedy completions, scored it, and stopped the server."""
    report = json.loads((runs / "serving" / "serving.json").read_text())
    assert report["verdict"] == "passed", report["checks"]
    load = report["load"]
    assert load["requests"] == 32 and load["failed"] == 0 and load["error_rate"] == 0, load
    assert load["output_tokens"] == 32 * 16 and load["output_tokens_per_s"] > 0, load
    for metric in ("ttft_ms", "itl_ms", "e2e_ms"):  # tokens that arrive in one chunk have gaps of microseconds
        figures = load[metric]
        assert 0 <= figures["p50"] <= figures["p95"] <= figures["p99"] and figures["p99"] > 0, (metric, figures)
    assert load["ttft_ms"]["p50"] <= load["e2e_ms"]["p50"], load
    parity = report["parity"]
    assert (parity["prompts"], parity["tokens"], parity["matched"]) == (4, 8, 4), parity
    # the parity chain: the export's load-time check, then what vLLM serves against our model (fp32 both)
    chain = report["chain"]
    assert chain["passed"] and not chain["missing"], chain
    assert [(h["hop"], h["measure"]) for h in chain["hops"]] == [
        ("training -> export", "max |logit difference|"), ("export -> served", "greedy prompts identical"),
        ("export -> served", "max |log-probability difference|")], chain  # fmt: skip
    assert 0 <= chain["hops"][0]["measured"] <= chain["hops"][0]["tolerance"] and chain["hops"][1]["measured"] == 1
    assert report["logprobs"]["tokens"] == 4 * 31 and report["logprobs"]["max_abs_diff"] < 1e-2, report["logprobs"]
    quality = report["quality"]
    assert quality["prompts"] == 16 and 0 <= quality["rouge_l"] <= 1 and 0 <= quality["bleu4"] <= 100, quality
    server = report["server"]
    # the engine decoded several of the load's requests per step (the sampled running gauge can miss a short load)
    assert server["samples"] > 0 and server["output_tokens_per_step"] > 1, server
    assert server["kv_cache_usage_max"] is not None and server["mean_batch_tokens"] > 0, server
    with pytest.raises(ProcessLookupError):  # the server and every process of its group are gone
        os.killpg(report["server_pid"], 0)
    model = runs.parent.parent / report["model_dir"]  # relative to where tdeploy ran, like every report path
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 32, config
    card = (model / "README.md").read_text()  # the model card carries this deployment's acceptance figures
    assert "## Training figures (acceptance: passed)" in card and "| correctness | passed |" in card, card
    suite = ET.parse(runs / "serving" / "junit.xml").getroot()
    assert suite.get("failures") == "0" and int(suite.get("tests")) == len(report["checks"])
    assert (runs / "serving" / "latency_histogram.png").read_bytes()[:4] == b"\x89PNG"
    assert {"serving-k8s.yaml", "serving.sbatch"} <= {Path(f).name for f in report["files"].values()}
    assert report["model_dir"] == "runs/local/export/step-200"  # the accepted checkpoint, where tdeploy export puts it


def _quality(root: Path) -> dict:
    """The quality gate's part of the correctness dimension in the run workspace `root`."""
    acceptance = json.loads((root / "acceptance.json").read_text())
    correctness = next(d for d in acceptance["dimensions"] if d["name"] == "correctness")
    return {"measured": correctness["measured"]["quality"], "evidence": correctness["evidence"]["quality"]}


def _every_drill_recovered(drills: list[dict]) -> None:
    """Every drill passed with its state matching the uninterrupted run, and left the evidence that says so."""
    results = {d["name"]: d for d in drills}
    assert set(results) == DRILLS | {"node_loss"}
    # The embedded default is one node without spares: nothing to lose, no peer node's memory, no spare, no other
    # host to quarantine: each said so.
    for name in ("node_loss", "memory_restore", "spare_takeover", "bad_node_recurrence"):
        skipped = results.pop(name)
        assert skipped["passed"] is None and skipped["message"].startswith("skipped: "), skipped
    # A NaN loss: stopped as the workload's error, not retried (no state to match: the run is not meant to go on).
    workload = results.pop("workload_error")
    assert workload["passed"] and workload["steps_lost"] == 0, workload
    assert [d["action"] for d in workload["evidence"]["decisions"]] == ["stop"], workload["evidence"]
    for name, result in results.items():
        assert result["passed"], (name, result["message"], result["evidence"])
        assert result["state_matched"], name
        assert result["recovery_s"] is not None and result["recovery_s"] >= 0, name
    every = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())["acceptance"]["save_every_steps"]
    # kill_during_save killed every rank at each phase of the second save; each relaunch resumed from a whole one
    save = results["kill_during_save"]["evidence"]
    phases = {p["phase"]: p for p in save["phases"]}
    assert list(phases) == list(SAVE_PHASES) and save["save_step"] == 2 * every
    for phase in phases.values():
        assert phase["passed"] and phase["whole"] and phase["problems"] == [] and phase["state_matched"], phase
    for name in ("writing_dcp", "after_dcp", "after_extras"):  # killed before the commit: the previous one
        phase = phases[name]
        assert phase["resumed_from"] == phase["expected_step"] == every, phase
        assert phase["partial_skipped_with_warning"], phase
    after_commit = phases["after_commit"]
    assert after_commit["resumed_from"] == 2 * every and after_commit["partial_skipped_with_warning"] is None
    # each kill left what its phase names: part of the DCP data, all of it, the small files, the commit
    at_kill = {name: set(p["files_at_kill"]) for name, p in phases.items()}
    assert DCP_METADATA not in at_kill["writing_dcp"] and any(f.endswith(".distcp") for f in at_kill["writing_dcp"])
    assert DCP_METADATA in at_kill["after_dcp"] and TRAIN_STATE not in at_kill["after_dcp"]
    assert {TRAIN_STATE, rng_file(0), rng_file(1)} <= at_kill["after_extras"] and COMMIT not in at_kill["after_extras"]
    assert COMMIT in at_kill["after_commit"]
    assert results["corrupt_checkpoint"]["evidence"]["detected_and_skipped"]
    reshard = results["reshard"]["evidence"]
    assert reshard["to_world_size"] == 1 and reshard["reshard_reported"], reshard
    # dropout on: per-rank dropout streams cannot be replayed on one rank, so a same-layout resume is the judge
    assert reshard["compared_with"].startswith("same-layout resume"), reshard
    assert results["storage_outage"]["evidence"]["failed_save_step"] > every
    preempted = results["preemption"]  # SIGTERM: checkpointed at the step boundary, resubmitted, nothing lost
    assert preempted["steps_lost"] == 0 and preempted["evidence"]["state"] == "preempted", preempted
    # The ladder's rungs that one node has: a replica group lost and healed live (0 steps lost), a hang detected
    # and restarted from.
    assert results["replica_loss"]["steps_lost"] == 0, results["replica_loss"]
    assert results["hang"]["detection_s"] is not None, results["hang"]


@pytest.mark.timeout(5400)  # two whole runs, the first ~6 min alone and far longer on two shared cores
def test_the_main_job_passes_twice_in_a_row_resuming_training_and_accepting_afresh(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "TDEPLOY_HOME": str(tmp_path / "tdeploy-home"),
    }
    env.pop("PREFECT_API_URL", None)
    runs = tmp_path / "runs" / "local"

    _tdeploy_run(tmp_path, env)
    assert read_plan(str(runs / "plan.json")).fits
    assert NodeReport.read(runs / "node-check.json").ok
    first_result = json.loads((runs / "output" / "result.json").read_text())
    assert first_result["steps"] == 200 and first_result["resumed_from_step"] is None
    first = _latest_acceptance(runs, "sanity", drills=True)
    _served(runs)
    first_p99 = json.loads((runs / "serving" / "serving.json").read_text())["load"]["e2e_ms"]["p99"]

    # The second run is the same spec without the drills and the serving check the first one ran (`drills.only:
    # []`, `serve: null`): they do not depend on what is already in the folder, the resume and the baseline do.
    again = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    again["drills"] = {"only": []}
    again["serve"] = None
    (tmp_path / "local-again.yaml").write_text(yaml.safe_dump(again))
    _tdeploy_run(tmp_path, env, tmp_path / "local-again.yaml")
    second_result = json.loads((runs / "output" / "result.json").read_text())
    assert second_result["steps"] == 200 and second_result["resumed_from_step"] == 200, second_result
    steps = {row["step"]: row for row in json.loads((runs / "summary.json").read_text())["steps"]}
    assert steps["serving"]["verdict"] == "skipped", steps["serving"]
    second = _latest_acceptance(runs, "baseline", drills=False)  # held to the first
    assert second != first and second.parent == first.parent == runs / "acceptance"
    assert first.is_dir(), "the first run's workspace is kept (acceptance.keep_runs=3)"
    # the second run was judged against the first run's baseline, which it reproduced (deterministic CPU) and
    # left as it was: a later accepted run never replaces the baseline of its key
    quality = _quality(second)
    assert quality["measured"]["val_loss"] == quality["measured"]["baseline_val_loss"], quality
    assert quality["evidence"]["baseline_run_id"] == first.name and not quality["evidence"]["recorded"], quality
    assert json.loads(Path(quality["evidence"]["baseline_file"]).read_text())["run_id"] == first.name
    # the first run's acceptance entered the deployment ledger; the second was held to that entry and passed
    dimensions = json.loads((second / "acceptance.json").read_text())["dimensions"]
    regression = next(d for d in dimensions if d["name"] == "regression")
    entries = sorted(p.stem for p in (runs / "acceptance" / "ledger" / "entries").glob("*.json"))
    assert len(entries) == 2 and regression["passed"], (entries, regression)  # ids sort by time
    assert regression["evidence"]["baseline_entry"] == entries[0], regression
    # the serving step added the first entry's golden serving P99 beside it; the second served nothing
    served = json.loads((runs / "acceptance" / "ledger" / "serving" / f"{entries[0]}.json").read_text())
    assert served["p99_e2e_ms"] == first_p99 and served["step"] == 200, served
    assert not (runs / "acceptance" / "ledger" / "serving" / f"{entries[1]}.json").exists()

"""The model's parity chain: training forward -> export -> quantized -> served, each hop's measured deviation
against its tolerance, gathered from the records each step wrote where it was checked.

- training -> export: EXPORT.json's load-time check (tasks/export/parity.py): transformers' fp32 logits of the
  exported folder against our model's on the checkpoint, held-out prompts, max |logit difference|.
- export -> quantized: the quantize step's gate (quantization.json): vLLM serving the quantized folder against
  the unquantized export, perplexity increase on held-out sequences and greedy token agreement.
- -> served: the serving check itself: the served model's greedy completions against our model's, and its
  log-probabilities of the prompts' own tokens against ours (a figure: what a quantized model is expected to
  move, the quantize hop bounds).

A hop whose record is missing (a folder exported before load-time checks, a quantized folder served without
its gate's report) is left out of the chain and named in `missing`; the chain never invents a figure.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.paths import EXPORT_RECORD, QUANTIZE_RECORD
from validation.serving import LogprobFigures, ParityFigures, ParityHop, hop

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class ParityChain:
    """The hops in order, and the hops whose record was not there."""

    hops: list[ParityHop]
    missing: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """No gated hop failed."""
        return all(h.passed is not False for h in self.hops)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        log.warning("parity chain: %s cannot be read (%s)", path, err)
        return None
    return data if isinstance(data, dict) else None


def _export_hop(export_dir: Path) -> ParityHop | str:
    record = _read(export_dir / EXPORT_RECORD)
    parity = (record or {}).get("parity")
    if not isinstance(parity, dict):
        return f"training -> export: {export_dir / EXPORT_RECORD} holds no load-time check (exported before it)"
    compared = (f"transformers (fp32) loading {export_dir} vs our model on the checkpoint, {parity['prompts']} "
                f"prompts of {parity['prompt_tokens']} tokens ({parity['prompts_from']})")  # fmt: skip
    return hop("training -> export", compared, "max |logit difference|", float(parity["max_abs_logit_diff"]),
               float(parity["tolerance"]), True, str(export_dir / EXPORT_RECORD))  # fmt: skip


def _quantize_hops(served_dir: Path, quantization_json: Path) -> list[ParityHop] | str:
    report = _read(quantization_json)
    if report is None:
        return f"export -> quantized: {quantization_json} cannot be read"
    quantized = report.get("quantized") or {}
    if Path(str(quantized.get("model_dir"))).resolve() != served_dir.resolve():
        return (f"export -> quantized: {quantization_json} is the gate of {quantized.get('model_dir')}, not of the "
                f"served {served_dir}")  # fmt: skip
    checks = {c["name"]: c for c in report.get("checks", []) if isinstance(c, dict)}
    name = f"export -> quantized ({quantized.get('scheme')}, {quantized.get('method')})"
    base, measured = report.get("base") or {}, report.get("measured") or {}
    compared = (f"vLLM serving {served_dir.name} vs the unquantized export, {measured.get('eval_tokens')} held-out "
                f"tokens (perplexity {base.get('perplexity', float('nan')):.4f} -> "
                f"{measured.get('perplexity', float('nan')):.4f})")  # fmt: skip
    hops = []
    for check, measure, upper in (("perplexity_increase", "perplexity increase", True),
                                  ("greedy_agreement", "next tokens predicted alike (teacher-forced)", False)):  # fmt: skip
        if check in checks and checks[check].get("value") is not None:
            bound = checks[check].get("bound")
            hops.append(hop(name, compared, measure, float(checks[check]["value"]),
                            None if bound is None else float(bound), upper, str(quantization_json)))  # fmt: skip
    return hops or f"export -> quantized: {quantization_json} holds no gated figure"


def parity_chain(
    served_dir: Path, quantization_json: Path | None, parity: ParityFigures, logprobs: LogprobFigures,
    greedy_match_min: float | None, serving_json: Path,
) -> ParityChain:  # fmt: skip
    """The chain of the served folder: its export's check, its quantization's gate when it is a quantized folder,
    and the serving check's own figures (`parity`, `logprobs`)."""
    hops: list[ParityHop] = []
    missing: list[str] = []
    quantize_record = _read(served_dir / QUANTIZE_RECORD) if (served_dir / QUANTIZE_RECORD).exists() else None
    export_dir = Path(quantize_record["source"]["model_dir"]) if quantize_record else served_dir
    found = _export_hop(export_dir)
    hops.append(found) if isinstance(found, ParityHop) else missing.append(found)
    if quantize_record is not None:
        if quantization_json is None:
            missing.append(f"export -> quantized: {served_dir} is a quantized folder served without its gate's "
                           "report (quantization.json); run the quantize step or `tdeploy quantize`")  # fmt: skip
        else:
            gated = _quantize_hops(served_dir, quantization_json)
            hops.extend(gated) if isinstance(gated, list) else missing.append(gated)
    before = "quantized" if quantize_record is not None else "export"
    compared = f"vLLM serving {served_dir.name} vs our model on the checkpoint, {parity.prompts} held-out prompts"
    hops.append(hop(f"{before} -> served", f"{compared}, first {parity.tokens} greedy tokens",
                    "greedy prompts identical", parity.share, greedy_match_min, False, str(serving_json)))  # fmt: skip
    hops.append(hop(f"{before} -> served", f"{compared}, {logprobs.tokens} prompt tokens' log-probabilities",
                    "max |log-probability difference|", logprobs.max_abs_diff, None, True, str(serving_json)))  # fmt: skip
    return ParityChain(hops, missing)


def chain_rows(chain: ParityChain) -> list[dict[str, str]]:
    """The chain as a table (the Prefect artifact and `tdeploy serve`): hop, measure, measured, tolerance,
    verdict, what was compared."""
    verdict = {True: "pass", False: "FAIL", None: "figure"}
    rows = [
        {"hop": h.hop, "measure": h.measure, "measured": f"{h.measured:.4g}",
         "tolerance": "-" if h.tolerance is None else f"{'<=' if h.upper else '>='} {h.tolerance:.4g}",
         "verdict": verdict[h.passed], "compared": h.compared}  # fmt: skip
        for h in chain.hops
    ]
    rows += [{"hop": m.split(":")[0], "measure": "-", "measured": "-", "tolerance": "-", "verdict": "missing",
              "compared": m} for m in chain.missing]  # fmt: skip
    return rows

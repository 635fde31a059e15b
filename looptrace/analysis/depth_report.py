"""`looptrace depth`'s report as text: the q90 table, the recommendation, R_layer and Amdahl, the plots
(plotext, written as plain text: files and pipes get no ANSI codes) and the --validate lines; CSV rows."""

from __future__ import annotations

import csv
import io
import json
import re

from looptrace.analysis.depth import PAPER_DECODE_TAU, ROLE_LABELS, ROLES

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def render(report: dict, fmt: str, *, by_depth: bool) -> str:
    """The report as json, csv or the table text."""
    if fmt == "json":
        return json.dumps(report, indent=2, default=str)
    if fmt == "csv":
        return accuracy_csv(report) if by_depth else q90_csv(report)
    return accuracy_text(report) if by_depth else analysis_text(report)


def q90_csv(report: dict) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["S", "P", "prompt", "final_prefill", "decode"], lineterminator="\n")
    w.writeheader()
    w.writerows(report["q90"])
    return buf.getvalue().rstrip("\n")


def analysis_text(report: dict) -> str:
    """The analysis (and its --validate part) as the table report."""
    h, lm = report["header"], report["layer_model"]
    lines = [
        f"{h['model_preset']} ({h['family']}), weights: {h['weights']}; {report['prompts']} prompts, "
        f"{report['answers']} answers replayed at S_ref={report['s_ref']}",
        f"tokens by role: {report['tokens_by_role']}",
        "",
        f"q90 of d_i(P; S={report['S']}) = ||h^P - h^S|| / ||h^S||",
        f"{'P':>3} {'prompt':>10} {'final':>10} {'decode':>10}",
    ]
    for r in report["q90_at_S"]:
        cells = " ".join(
            f"{'-' if r[k] is None else format(r[k], '.4f'):>10}"
            for k in ("prompt", "final_prefill", "decode")
        )
        lines.append(f"{r['P']:>3} {cells}")
    lines += [
        "",
        f"recommended: {_split_text(report['recommended'])}  "
        f"(smallest P with prompt-token q90 <= tau={report['tau']})",
        f"R_layer (Eq. 3) at P={lm['P']}: {lm['R_layer']:.3f}  (L={lm['mean_prompt_len_L']}, "
        f"D={lm['mean_output_len_D']}, M={lm['mean_chunks_M']}, "
        f"layers a/b/c={lm['layers_prelude_core_coda']})",
        f"prefill time fraction f={lm['prefill_time_fraction_f']:.3f} (engine step events), "
        f"prefill layer ratio r={lm['R_prefill']:.3f} -> Amdahl R_time (Eq. 4, eps=0) = "
        f"{lm['R_time_amdahl']:.3f}",
        "",
        _q90_plot(report),
    ]
    if "validate" in report:
        lines += validate_lines(report["validate"])
    return "\n".join(lines)


def _split_text(rec: dict) -> str:
    if rec["split"]:
        return f"(S, P) = ({rec['S']}, {rec['P']})"
    return f"no P < S meets tau: run ({rec['S']}, {rec['S']})"


def _q90_plot(report: dict) -> str:
    # deferred: optional plotting library
    import plotext as plt

    rows = report["q90_at_S"]
    xs = [r["P"] for r in rows]
    plt.clear_figure()
    plt.plot_size(78, 20)
    plt.theme("clear")
    for role, marker in zip(ROLES, ("dot", "x", "+")):
        pts = [(x, r[role]) for x, r in zip(xs, rows) if r[role] is not None]
        if pts:
            plt.plot([a for a, _ in pts], [b for _, b in pts], label=ROLE_LABELS[role], marker=marker)
    plt.horizontal_line(report["tau"])
    plt.horizontal_line(PAPER_DECODE_TAU)
    plt.title(f"q90 of d(P; S={report['S']}) vs prefill loops P  (lines: tau={report['tau']}, decode 0.11)")
    plt.xlabel("P (loops)")
    plt.xticks(xs)
    return _ANSI.sub("", plt.build())


def accuracy_csv(report: dict) -> str:
    return "loops,exact_match,stderr,n\n" + "\n".join(
        f"{r['loops']},{r['exact_match']},{r['stderr']},{r['n']}" for r in report["accuracy_by_depth"]
    )


def accuracy_text(report: dict) -> str:
    h = report["header"]
    lines = [
        f"{h['model_preset']} ({h['family']}), weights: {h['weights']}",
        f"{'loops':>5} {'exact match':>12} {'± se':>8} {'n':>5}",
    ]
    lines += [
        f"{r['loops']:>5} {r['exact_match'] * 100:>11.1f}% {r['stderr'] * 100:>7.1f} {r['n']:>5}"
        for r in report["accuracy_by_depth"]
    ]
    return "\n".join(lines)


def validate_lines(v: dict) -> list[str]:
    """report["validate"] as lines: the parts that finished (all of them unless interrupted)."""
    if "S" not in v:
        return ["", "--validate: interrupted before its first run"]
    s, p, w = v["S"], v["P"], v["workload"]
    lines = [
        "",
        f"--validate: kv.layout=shared, burst of {w['requests']} x {w['prompt_len']}-token prompts, "
        f"{w['answer_len']} output tokens, best of {w['repeats']}",
    ]
    if v.get("interrupted"):
        runs = v.get("timed_runs_s") or {}
        lines.append(
            "  interrupted: timed runs done "
            + ", ".join(f"{k} {len(x)}/{w['repeats']}" for k, x in runs.items())
            + "; the parts below are the ones that finished"
        )
    lines += _measured_lines(v, f"({s},{s})", f"({s},{p})")
    c = v.get("controller")
    if c:
        lines.append(
            f"  controller (P_max={c['p_max']}, P_min={c['p_min']}), {c['workload']}: P first "
            f"{c['p_first']}, lowest {c['p_lowest']}, last {c['p_last']} (recovered: {c['recovered']})"
        )
    if c and c["timeline_s_p_q"]:
        lines.append(_controller_plot(c["timeline_s_p_q"]))
    return lines


def _measured_lines(v: dict, ss: str, sp: str) -> list[str]:
    lines = []
    if "throughput_req_s" in v:
        lines += [
            f"  throughput {ss} {v['throughput_req_s'][ss]:.3f} req/s, "
            f"{sp} {v['throughput_req_s'][sp]:.3f} req/s: speedup {v['speedup']:.3f}x vs R_layer "
            f"{v['R_layer']:.3f} ({v['fraction_of_R_layer'] * 100:.0f}%)",
            f"  median TTFT {ss} {v['median_ttft_s'][ss]:.3f} s, {sp} {v['median_ttft_s'][sp]:.3f} s; "
            f"token agreement {v['token_agreement'] * 100:.1f}%",
        ]
    acc = v.get("eval_exact_match")
    if acc:
        lines.append(
            f"  eval exact match {ss} {acc[ss] * 100:.1f}%, {sp} {acc[sp] * 100:.1f}%: difference "
            f"{acc['difference'] * 100:+.1f} +- {acc['paired_se'] * 100:.1f} pts (paired SE, n={acc['n']})"
        )
    return lines


def _controller_plot(timeline: list) -> str:
    # deferred: optional plotting library
    import plotext as plt

    plt.clear_figure()
    plt.plot_size(78, 12)
    plt.theme("clear")
    plt.scatter([t for t, _, _ in timeline], [q for _, q, _ in timeline], marker="dot")
    plt.title("queue-age controller: P at each prefill step vs time (s)")
    return _ANSI.sub("", plt.build())

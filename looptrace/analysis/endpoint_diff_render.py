"""An endpoint diff report (`analysis.endpoint_diff.execute`) as text tables or CSV. Served text is user
data (a model can print `[bold]`): it is escaped before Rich sees it."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

MAX_REQUEST_ROWS = 24
STYLE = {
    "identical": "green",
    "same-distribution": "green",
    "changed-within-noise": "yellow",
    "changed-beyond-noise": "bold red",
    "error": "bold red",
}
CSV_FIELDS = [
    *("id", "verdict", "tokens_a", "tokens_b", "first_divergence", "token_a", "token_b", "text_a", "text_b"),
    *("logprob_a", "logprob_b", "margin_a", "margin_b", "later_differ", "logprobs_first_differ"),
    *("max_logprob_delta", "error"),
]


def render(data: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(data, indent=2, default=str)
    return to_csv(data) if fmt == "csv" else to_text(data)


def to_csv(data: dict[str, Any]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in data["requests"]:
        writer.writerow({k: r[k] for k in CSV_FIELDS})
    return buf.getvalue().rstrip()


def to_text(data: dict[str, Any]) -> str:
    console = Console(width=140, record=True, file=io.StringIO(), force_terminal=False)
    console.print(Group(*renderables(data)))
    return console.export_text().rstrip()


def renderables(data: dict[str, Any]) -> list:
    h, sm = data["header"], data["summary"]
    out: list = [_head_panel(h)]
    out.append(
        f"A vs B: {sm['identical']}/{sm['requests']} identical, {sm['same-distribution']} same-distribution, "
        f"{sm['changed-within-noise']} changed within noise, {sm['changed-beyond-noise']} beyond noise, "
        f"{sm['error']} failed; {sm['elapsed_s']:.1f} s"
    )
    out.append(_requests_table(data["requests"], "Requests (A vs B)"))
    for arm, probe in (data.get("batch_probe") or {}).items():
        c = probe["counts"]
        moved = sum(r["logprobs_first_differ"] is not None for r in probe["requests"])
        out.append(
            f"batch probe, arm {arm.upper()}: {c['identical']}/{len(probe['requests'])} identical alone and "
            f"in a crowd of {probe['crowd']} ({_styled(probe['overall'])}); logprobs moved in {moved}"
        )
        if probe["overall"] != "identical":
            out.append(_requests_table(probe["requests"], f"Arm {arm.upper()}: alone vs in the crowd"))
    if data.get("reference") is not None:
        out += _reference_part(data["reference"], data["requests"])
    if data.get("accuracy") is not None:
        out.append(_accuracy_line(data["accuracy"]))
    out.append(_verdict_line(data["verdict"]))
    return out


def _head_panel(h: dict[str, Any]) -> Panel:
    def arm(a: dict) -> str:
        where = f"{a['label']}  model '{a['model']}'"
        if "dtype" in a:
            where += f"  ({a['preset']}, {a['device']}, {a['dtype']})"
        return escape(where)

    n = h["noise"]
    head = (
        f"A [bold]{arm(h['arms']['a'])}[/]\nB [bold]{arm(h['arms']['b'])}[/]\n"
        f"workload {escape(h['workload'])}\n"
        f"near tie: margin <= {n['margin']:g} nats ({n['dtype']}"
        + (", --noise-margin" if n["source"] != "dtype" else ", rule of thumb")
        + ")"
    )
    return Panel(head, title="looptrace diff (endpoints)", expand=False)


def _tok(token: int | None, text: str | None) -> str:
    return "-" if token is None else f"{token} {escape(repr(text))}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _pair(a: float | None, b: float | None) -> str:
    return "-" if a is None and b is None else f"{_num(a)} / {_num(b)}"


def _requests_table(rows: list[dict], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("req", no_wrap=True)
    t.add_column("verdict", no_wrap=True)
    t.add_column("first diff", justify="right")
    for col in ("A token", "B token", "logprob A / B", "margin A / B"):
        t.add_column(col, no_wrap=True)
    for col in ("later differ", "logprobs differ from", "max |dlogprob|"):
        t.add_column(col, justify="right")
    shown = [r for r in rows if r["verdict"] != "identical" or r["logprobs_first_differ"] is not None]
    for r in (shown or rows)[:MAX_REQUEST_ROWS]:
        verdict = _styled(r["verdict"]) + (f" ({escape(r['error'])})" if r["error"] else "")
        t.add_row(
            r["id"],
            verdict,
            "-" if r["first_divergence"] is None else str(r["first_divergence"]),
            _tok(r["token_a"], r["text_a"]),
            _tok(r["token_b"], r["text_b"]),
            _pair(r["logprob_a"], r["logprob_b"]),
            _pair(r["margin_a"], r["margin_b"]),
            str(r["later_differ"]),
            "-" if r["logprobs_first_differ"] is None else str(r["logprobs_first_differ"]),
            f"{r['max_logprob_delta']:.3g}",
        )
    hidden = len(rows) - min(len(shown or rows), MAX_REQUEST_ROWS)
    if hidden:
        t.caption = f"{hidden} more request(s) not shown (identical tokens and logprobs, or past the limit)"
    return t


def _reference_part(ref: dict[str, Any], rows: list[dict]) -> list:
    n = ref["noise"]
    flip = "none" if n["min_flip_margin"] is None else f"{n['min_flip_margin']:.3g}"
    head = (
        f"reference {escape(ref['preset'])} ({ref['dtype']}, {ref['device']}): noise {n['dtype']} vs "
        f"{ref['dtype']} over {n['positions']} positions: max |dlogprob| {n['max_abs_dlogprob']:.3g}, "
        f"q99 {n['q99_abs_dlogprob']:.3g}, {n['argmax_flips']} argmax flip(s) (smallest margin {flip}); "
        f"near tie: |margin| <= {n['margin']:.3g} nats"
    )
    for arm, agree in ref["agreement"].items():
        if agree["positions"]:
            head += (
                f"\narm {arm.upper()}: served token = reference argmax at {agree['argmax_agree']}/"
                f"{agree['positions']} positions; max |served - reference logprob| "
                f"{_num(agree['max_abs_dlogprob'])}"
            )
    judged = [r for r in rows if r.get("judge")]
    if not judged:
        return [head + "; no divergence to judge"]
    t = Table(title="Reference judge (first divergence)", title_justify="left")
    for col in ("req", "pos", "A token", "B token", "ref argmax"):
        t.add_column(col, no_wrap=True)
    for col in ("ref logprob A", "ref logprob B", "margin A - B"):
        t.add_column(col, justify="right")
    t.add_column("blame", no_wrap=True)
    for r in judged[:MAX_REQUEST_ROWS]:
        j = r["judge"]
        blame = j["blame"] if j["blame"] == "near tie" else f"[bold red]{j['blame']}[/]"
        t.add_row(
            r["id"],
            str(r["first_divergence"]),
            _tok(r["token_a"], r["text_a"]),
            _tok(r["token_b"], r["text_b"]),
            str(j["ref_argmax"]),
            f"{j['ref_logprob_a']:.4g}",
            f"{j['ref_logprob_b']:.4g}",
            f"{j['ref_margin']:+.4g}",
            blame,
        )
    return [head, t]


def _styled(verdict: str) -> str:
    return f"[{STYLE.get(verdict, '')}]{verdict}[/]"


def _accuracy_line(acc: dict[str, Any]) -> str:
    rule = "holds" if acc["holds"] else "[bold red]misses[/]"
    failed = sum(len(v) for v in acc["failed"].values())
    extra = f"; {failed} request(s) failed" if failed else ""
    a, b = 100 * acc["a_accuracy"], 100 * acc["b_accuracy"]
    return (
        f"accuracy on {escape(acc['file'])} ({acc['n']} questions, exact match): A {a:.1f}%, B {b:.1f}%, "
        f"B - A {acc['diff_points']:+.2f} points (s.e. {acc['se_points']:.2f}): "
        f"{rule} the one-point rule{extra}"
    )


def _verdict_line(v: dict[str, Any]) -> str:
    text = f"overall: {_styled(v['overall'])}"
    if v["failed"]:
        text += f"; {len(v['failed'])} request(s) failed: {', '.join(v['failed'])}"
    if v["accuracy_holds"] is False:
        text += "; [bold red]accuracy misses the one-point rule[/]"
    if v["expect"] is None:
        return text + " (no claim on the streams: --expect identical|noise states one)"
    if v["violations"]:
        return text + f"; [bold red]claim '{v['expect']}' violated: {', '.join(v['violations'])}[/]"
    return text + f"; [green]claim '{v['expect']}' holds[/]"

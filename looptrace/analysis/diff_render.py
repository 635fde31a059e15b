"""A diff report (`analysis.diff_run.report_data`) as text tables or CSV."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table

MAX_REQUEST_ROWS = 24

STYLE = {
    "holds": "green",
    "violated": "bold red",
    "reported": "cyan",
    "unchecked": "yellow",
    "untested": "yellow",
}


def render(data: dict[str, Any], fmt: str) -> str:
    """The report as json, csv or the table text."""
    if fmt == "json":
        return json.dumps(data, indent=2, default=str)
    return to_csv(data) if fmt == "csv" else to_text(data)


def to_text(data: dict[str, Any]) -> str:
    """The report as plain text: panels and tables, 140 columns."""
    console = Console(width=140, record=True, file=io.StringIO(), force_terminal=False)
    console.print(Group(*renderables(data)))
    return console.export_text().rstrip()


def _fmt(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _ev(ev: dict | None) -> str:
    if not ev:
        return "-"
    text = f"{ev['identical']}/{ev['total']}"
    if ev.get("logits_identical") is not None:
        text += f" (logits {ev['logits_identical']})"
    return text


def _m(m: dict | None) -> str:
    if not m:
        return "-"
    return f"{m['margin']:.3g}" + (" near-tie" if m["near_tie"] else "")


def _head_panel(h: dict[str, Any]) -> Panel:
    def arm(r):
        return r["name"] + (" + " + ", ".join(r["overrides"]) if r["overrides"] else "")

    head = (
        f"A [bold]{arm(h['recipes']['a'])}[/]  vs  B [bold]{arm(h['recipes']['b'])}[/]   claimed rung "
        f"{h['claimed_rung']}\n"
        f"[bold]{h['model_preset']}[/] ({h['family']}, {h['loops']} loops, weights: {h['weights']})  "
        f"device {h['device']}  dtype {h['dtype']}\nworkload {h['workload']}"
    )
    return Panel(head, title="looptrace diff", expand=False)


def renderables(data: dict[str, Any]) -> list:
    sm = data["summary"]
    out: list = [_head_panel(data["header"]), _settings_table(data["toggles"])]
    for g in data["toggles"]:
        if g["verdict"] != "holds" or g["device_check"]:
            style = STYLE.get(g["verdict"], "")
            out.append(f"  [{style}]{g['path']}[/]: {g['reason']}")
    out.append(
        f"A vs B: {sm['identical_batched']}/{sm['requests']} identical batched, {sm['identical_solo']}/"
        f"{sm['requests']} at batch 1; bitwise logits {_fmt(sm['logits_identical_batched'])} / "
        f"{_fmt(sm['logits_identical_solo'])}; {sm['runs']} runs, {sm['elapsed_s']:.1f} s in all"
    )
    out.append(_requests_table(data["requests"], "Requests, batched (A vs B)"))
    if any(not r["identical"] for r in data["solo_requests"]):
        out.append(_requests_table(data["solo_requests"], "Requests, batch 1 (A vs B)"))
    if data.get("bisect") is not None:
        out.append(_bisect_text(data["bisect"]))
    for p in data.get("perturb") or []:
        if not p["hits"]:
            out.append(
                f"[yellow]debug.perturb {p['place']} never fired[/] (0 outputs bumped in {p['runs']} "
                "run(s)): no op output matched that stage, loop and layer"
            )
    if data.get("localize") is not None:
        out.append(_localize_text(data["localize"]))
    if data.get("accuracy") is not None:
        out += _accuracy_lines(data["accuracy"])
    v = data["verdict"]
    if v["ok"]:
        out.append(_holds_text(data["toggles"]))
    else:
        out.append(f"[bold red]{len(v['violations'])} claim(s) violated: {', '.join(v['violations'])}[/]")
    return out


def _settings_table(toggles: list[dict]) -> Table:
    t = Table(title="Settings that differ (graded)", title_justify="left")
    for col in (
        "setting",
        "A",
        "B",
        "claimed",
        "graded",
        "batched ident.",
        "batch-1 ident.",
        "evidence",
        "verdict",
    ):
        t.add_column(col)
    for g in toggles:
        style = STYLE.get(g["verdict"])
        t.add_row(
            g["path"],
            _fmt(g["a"]),
            _fmt(g["b"]),
            g["declared_rung"],
            g["graded_rung"],
            _ev(g["batched"]),
            _ev(g["solo"]),
            g["evidence"],
            f"[{style}]{g['verdict'].upper()}[/]",
        )
    return t


def _bisect_text(b: dict[str, Any]) -> str:
    if b["criterion"] == "none":
        return "[bold]bisect[/]: A and B are identical (tokens and logits): nothing to bisect"
    bases = b.get("baselines") or [[] for _ in b["causes"]]
    causes = "; ".join(
        "{" + ", ".join(c) + "}" + (f" (on A+{','.join(base)})" if base else "")
        for c, base in zip(b["causes"], bases)
    )
    causes = causes or "none found"
    return (
        f"[bold]bisect[/] ({b['criterion']} diverge, {len(b['tested'])} subsets run): [bold red]{causes}[/]"
    )


def _accuracy_lines(a: dict[str, Any]) -> list[str]:
    style = "green" if a["holds"] else "bold red"
    out = [
        f"[bold]accuracy[/] ({a['file']}, {a['n']} questions, weights {a['weights']}): "
        f"A {a['a_accuracy']:.2f}% B {a['b_accuracy']:.2f}%  [{style}]{a['note']}[/]  "
        f"({a['sequences_differ']} answers differ)"
    ]
    for x in a.get("by_setting") or []:
        style = "green" if x["holds"] else "bold red"
        on = f" on A+{','.join(x['baseline'])}" if x["baseline"] else ""
        out.append(
            f"  {x['setting']} on its own{on}: A {x['a_accuracy']:.2f}% B {x['b_accuracy']:.2f}%  "
            f"[{style}]{x['note']}[/]"
        )
    return out


def _holds_text(toggles: list[dict]) -> str:
    """No claim violated: say which claims were not put to the test at all."""
    count = {kind: sum(g["verdict"] == kind for g in toggles) for kind in ("untested", "unchecked")}
    notes = []
    if count["untested"]:
        notes.append(f"{count['untested']} setting(s) untested: no effect here")
    if count["unchecked"]:
        notes.append(f"{count['unchecked']} R3 setting(s) unchecked: no --accuracy set")
    if not notes:
        return "[bold green]every claim holds[/]"
    return f"[bold green]every tested claim holds[/] ({'; '.join(notes)})"


def _requests_table(rows: list[dict], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in (
        "id",
        "identical",
        "common prefix",
        "first div.",
        "A tok",
        "B tok",
        "A margin",
        "B margin",
        "logits",
    ):
        t.add_column(col)
    shown = [r for r in rows if not r["identical"]][:MAX_REQUEST_ROWS] or rows[:MAX_REQUEST_ROWS]
    for r in shown:
        fd = r["first_divergence"]
        at = r["a_tokens"][fd] if fd is not None and fd < len(r["a_tokens"]) else "-"
        bt = r["b_tokens"][fd] if fd is not None and fd < len(r["b_tokens"]) else "-"
        t.add_row(
            r["id"],
            "yes" if r["identical"] else "[red]no[/]",
            str(r["common_prefix"]),
            _fmt(fd),
            str(at),
            str(bt),
            _m(r["margins"]["a"]),
            _m(r["margins"]["b"]),
            {True: "bitwise", False: "differ", None: "-"}[r["logits_identical"]],
        )
    hidden = len(rows) - len(shown)
    if hidden:
        t.caption = f"{hidden} identical or further request(s) not shown; all are in --format json"
    return t


def _localize_text(loc: dict[str, Any]) -> str:
    if not loc.get("diverged", True):
        return (
            f"[bold]localize {loc['request']}[/]: no divergence to localize (A and B give {loc['request']} "
            "identical tokens and bitwise-identical logits, batched and at batch 1)"
        )
    if not loc["found"]:
        return (
            f"[bold]localize {loc['request']}[/]: alone, no op output differs ({loc['ops_compared']} ops "
            f"compared, {loc['max_tokens']} tokens): the divergence needs batch-mates (batch composition, R1)"
        )
    detail = (
        f"max {loc['max_ulp']} ulp, {loc['elements_differ']}/{loc['elements']} elements, max |diff| "
        f"{loc['max_abs']:.3g}"
        if loc["problem"] == "values"
        else loc["problem"]
    )
    return (
        f"[bold]localize {loc['request']}[/]: first differing op [bold red]{loc['place']}[/] "
        f"({loc['module']}, {loc['op_kind']}): {detail}; {loc['ops_differ']}/{loc['ops_compared']} op "
        "outputs differ from there on"
    )


CSV_COLUMNS = ["kind", "name", "mode", "identical", "common_prefix", "first_divergence", "a", "b"]
CSV_COLUMNS += ["claimed", "graded", "verdict", "detail"]


def to_csv(data: dict[str, Any]) -> str:
    """One row per graded setting and mode, then one per request and mode."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_COLUMNS)
    w.writerows(_setting_rows(data["toggles"]))
    w.writerows(_request_rows(data))
    return buf.getvalue().rstrip()


def _setting_rows(toggles: list[dict]) -> list[list]:
    rows = []
    for g in toggles:
        for mode in ("batched", "solo"):
            ev = g[mode]
            identical = f"{ev['identical']}/{ev['total']}" if ev else ""
            rows.append(["setting", g["path"], mode, identical, "", "", _fmt(g["a"]), _fmt(g["b"])])
            rows[-1] += [g["declared_rung"], g["graded_rung"], g["verdict"], g["reason"]]
    return rows


def _request_rows(data: dict[str, Any]) -> list[list]:
    out = []
    for mode, rows in (("batched", data["requests"]), ("solo", data["solo_requests"])):
        for r in rows:
            ma, mb = r["margins"]["a"], r["margins"]["b"]
            fd = "" if r["first_divergence"] is None else r["first_divergence"]
            tokens = [" ".join(map(str, r["a_tokens"])), " ".join(map(str, r["b_tokens"]))]
            margins = f"margins a={ma['margin'] if ma else ''} b={mb['margin'] if mb else ''}"
            out.append(["request", r["id"], mode, _fmt(r["identical"]), r["common_prefix"], fd, *tokens])
            out[-1] += ["", "", "", margins]
    return out

"""Issue 11's table of targets, filled from a run's results."""

from __future__ import annotations

from typing import Any

from benchmark.common import MiB
from benchmark.figures import committed_ratio, fmt_ms, fmt_x

ACK, ACK_PREP, DCP_STAGER = (
    "asyncckpt persistent",
    "asyncckpt persistent + prepare()",
    "dcp.async_save thread + DefaultStager",
)


def issue11_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of issue 11's table: ``target``, ``measured`` (text), ``goal`` and ``met``
    (True / False, None where this run did not measure it)."""
    wls = {w["name"]: w for w in res.get("workloads", [])}
    rows: list[dict[str, Any]] = []

    def row(target: str, goal: str, measured: str | None, met: bool | None) -> None:
        rows.append(
            {
                "target": target,
                "goal": goal,
                "measured": measured or "not measured in this run",
                "met": met if measured else None,
            }
        )

    def sys_of(wname: str, sname: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        w = wls.get(wname)
        return (w, w["systems"].get(sname)) if w else (None, None)

    # steady stall vs memcpy and vs DCP
    for wname, label in (("llm", "steady stall, LLM state"),):
        w, a = sys_of(wname, ACK)
        _, d = sys_of(wname, DCP_STAGER)
        if w and a:
            r = a["stall_s"] / w["limits"]["memcpy_s"]
            txt = f"{fmt_ms(a['stall_s'])} ms = {fmt_x(r)} memcpy ({fmt_ms(w['limits']['memcpy_s'])} ms)"
            if d:
                txt += f"; DCP {fmt_ms(d['stall_s'])} ms = {fmt_x(d['stall_s'] / w['limits']['memcpy_s'])}"
            row(label, "<= 1.3x memcpy and below DCP's", txt, r <= 1.3 and (d is None or a["stall_s"] < d["stall_s"]))
        else:
            row(label, "<= 1.3x memcpy and below DCP's", None, None)
    f = res.get("fsdp2")
    a = f["systems"].get(ACK) if f else None
    if f and a:
        d = f["systems"].get(DCP_STAGER)
        txt = f"{fmt_ms(a['stall_s'])} ms = {fmt_x(a['stall_memcpy_ratio'])} memcpy (max over ranks)"
        if d:
            txt += f"; DCP {fmt_ms(d['stall_s'])} ms = {fmt_x(d['stall_memcpy_ratio'])}"
        row(
            "steady stall, FSDP2 (2 ranks)",
            "<= 1.3x memcpy and below DCP's",
            txt,
            a["stall_memcpy_ratio"] <= 1.3 and (d is None or a["stall_s"] < d["stall_s"]),
        )
    else:
        row("steady stall, FSDP2 (2 ranks)", "<= 1.3x memcpy and below DCP's", None, None)
    w, a = sys_of("1G/4096", ACK)
    if w and a:
        r = a["stall_s"] / w["limits"]["memcpy_s"]
        row(
            "steady stall, 1 GiB in 4096 tensors",
            "<= 1.5x memcpy",
            f"{fmt_ms(a['stall_s'])} ms = {fmt_x(r)} memcpy ({fmt_ms(w['limits']['memcpy_s'])} ms)",
            r <= 1.5,
        )
    else:
        row("steady stall, 1 GiB in 4096 tensors", "<= 1.5x memcpy", None, None)
    for wname in ("1G/16", "1G/4096"):
        w, a = sys_of(wname, ACK)
        label = f"committed, {wname.split('/')[1]} tensors ({wname})"
        if w and a:
            r = committed_ratio(a, w["limits"])
            row(
                label,
                "<= 1.1x raw write + fsync",
                f"{fmt_ms(a['committed_s'])} ms = {fmt_x(r)} raw write+fsync",
                r <= 1.1,
            )
        else:
            row(label, "<= 1.1x raw write + fsync", None, None)
    w, a = sys_of("llm", ACK)
    _, p = sys_of("llm", ACK_PREP)
    _, d = sys_of("llm", DCP_STAGER)
    for sysfig, label in ((a, "first save, LLM state (default)"), (p, "first save, LLM state (with prepare())")):
        if sysfig and d:
            row(
                label,
                "<= DCP's first async_save",
                f"{fmt_ms(sysfig['first_stall_s'])} ms; DCP {fmt_ms(d['first_stall_s'])} ms",
                sysfig["first_stall_s"] <= d["first_stall_s"],
            )
        else:
            row(label, "<= DCP's first async_save", None, None)
    for wname in ("1G/4096", "llm"):
        w = wls.get(wname)
        loads = (w or {}).get("loads", {})
        # The default, verify='inline': every byte checked as it is read (one pass).
        inline, raw = loads.get("asyncckpt.load verify='inline'"), loads.get("raw read (cold cache)")
        label = f"load (verify on), {wname}"
        if inline and raw:
            r = inline["s"] / raw["s"]
            txt = f"{fmt_ms(inline['s'])} ms = {fmt_x(r)} raw read ({fmt_ms(raw['s'])} ms), verify='inline' (default)"
            first = loads.get("asyncckpt.load verify=True")
            if first:
                txt += f"; verify=True (checked first, two reads) {fmt_x(first['s'] / raw['s'])}"
            row(label, "<= 1.2x raw read (cold cache)", txt, r <= 1.2)
        else:
            row(label, "<= 1.2x raw read (cold cache)", None, None)
    tr = res.get("training")
    by_every = {}
    if tr:
        by_every = {tr["every"]: tr["systems"], **{x["every"]: x["systems"] for x in tr.get("sparser", [])}}
    for k in sorted(set(by_every) | {1, 4, 16}):
        sysk = by_every.get(k, {})
        a, t = sysk.get(ACK), sysk.get("torch.save (sync)")
        label = f"training loop, K = {k}"
        if a and t:
            o = sysk.get("asyncckpt persistent overlapped")
            row(
                label,
                "slowdown below synchronous torch.save's",
                f"{100 * a['slowdown']:+.1f} %"
                + (f" (overlapped {100 * o['slowdown']:+.1f} %)" if o else "")
                + f"; torch.save {100 * t['slowdown']:+.1f} %",
                a["slowdown"] < t["slowdown"],
            )
        else:
            row(label, "slowdown below synchronous torch.save's", None, None)
    for wname in ("1G/16", "1G/4096", "llm"):
        w, a = sys_of(wname, ACK)
        label = f"staging memory, {wname}"
        if w and a and a.get("peak_extra_bytes"):
            drift = (a["extra_after_last_bytes"] - a["extra_after_first_bytes"]) / w["bytes"]
            flat = abs(drift) <= 0.05
            row(
                label,
                "<= 1.1x the state, flat",
                f"peak extra {fmt_x(a['peak_extra_ratio'])} the state (all processes); after #1 / last "
                f"{a['extra_after_first_bytes'] / MiB:.0f} / {a['extra_after_last_bytes'] / MiB:.0f} MiB "
                f"({'flat' if flat else f'{100 * drift:+.0f} % of the state'})",
                a["peak_extra_ratio"] <= 1.1 and flat,
            )
        else:
            row(label, "<= 1.1x the state, flat", None, None)
    return rows


def issue35_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals of issue 35 (GPU rows, ``--device cuda``) as measured in this run, rows as
    :func:`issue11_targets`' (``met`` None where not measured): on the llm state, the
    steady stall <= 1.1x the pinned D2H copy and the first save <= 3x the steady stall
    (with and without prepare()); in the training loop, asyncckpt with overlapped staging
    <= 1 % slower than no checkpoint at K = 10 (the time until the device finished the
    steps, ``trained_s``: without the last save's write, which a long run pays once;
    with 1 and with 2 staging buffers), and never slower than without overlap."""
    rows: list[dict[str, Any]] = []

    def row(target: str, goal: str, measured: str | None, met: bool | None) -> None:
        rows.append({"target": target, "goal": goal, "measured": measured or "not measured in this run", "met": met})

    w = next((x for x in res.get("workloads", []) if x["name"] == "llm"), None)
    a = w["systems"].get(ACK) if w else None
    goal = "<= 1.1x the D2H copy into pinned memory"
    if w and a:
        r = a["stall_s"] / w["limits"]["memcpy_s"]
        row(
            "GPU: steady stall, llm",
            goal,
            f"{fmt_ms(a['stall_s'])} ms = {fmt_x(r)} the D2H copy ({fmt_ms(w['limits']['memcpy_s'])} ms)",
            r <= 1.1,
        )
    else:
        row("GPU: steady stall, llm", goal, None, None)
    for name, label in ((ACK, "GPU: first save, llm (default)"), (ACK_PREP, "GPU: first save, llm (prepare())")):
        s = w["systems"].get(name) if w else None
        if s:
            r = s["first_stall_s"] / s["stall_s"]
            row(label, "<= 3x the steady stall", f"{fmt_ms(s['first_stall_s'])} ms = {fmt_x(r)}", r <= 3)
        else:
            row(label, "<= 3x the steady stall", None, None)
    tr = res.get("training")
    by_every = {}
    if tr:
        by_every = {tr["every"]: tr["systems"], **{x["every"]: x["systems"] for x in tr.get("sparser", [])}}
    base10 = by_every.get(10, {}).get("no checkpoint")
    goal = "<= +1 % against no checkpoint (the last save's write left out)"
    for name, label in (
        (ACK + " overlapped", "GPU loop: overlapped, K = 10"),
        (ACK + " overlapped, 2 staging buffers", "GPU loop: overlapped, 2 staging buffers, K = 10"),
    ):
        o10 = by_every.get(10, {}).get(name)
        if o10 and base10:
            # A run's last save is committed inside its time (every system finishes its
            # work); in a short run that write (1.27 s for 1.6 GB on the H200 machine's
            # disk, 9 steps) is most of the slowdown, while a long run pays it once:
            # judged on the time until the steps' work (and the last copy) was done on
            # the device. (Runs before trained_s: the time less the drain, which also
            # left out the device's queued steps.)
            trained = o10.get("trained_s", o10["time_s"] - o10["drain_s"])
            steady = trained / base10["time_s"] - 1
            row(
                label,
                goal,
                f"{100 * steady:+.1f} % ({100 * o10['slowdown']:+.1f} % with the last save's write, "
                f"{fmt_ms(o10['drain_s'])} ms)",
                steady <= 0.01,
            )
        else:
            row(label, goal, None, None)
    for k in sorted(set(by_every) | {1, 4, 10}):
        plain, over = by_every.get(k, {}).get(ACK), by_every.get(k, {}).get(ACK + " overlapped")
        label, goal = f"GPU loop: overlap against none, K = {k}", "overlapped <= without overlap"
        if plain and over:
            row(
                label,
                goal,
                f"{100 * over['slowdown']:+.1f} % against {100 * plain['slowdown']:+.1f} %; per checkpoint "
                f"{fmt_ms(over['blocked_per_save_s'])} against {fmt_ms(plain['blocked_per_save_s'])} ms blocked",
                over["time_s"] <= plain["time_s"],
            )
        else:
            row(label, goal, None, None)
    return rows

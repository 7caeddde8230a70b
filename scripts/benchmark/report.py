"""The markdown report of a run's results (the JSON's dict)."""

from __future__ import annotations

from typing import Any

from benchmark.common import GiB, MiB
from benchmark.figures import committed_ratio, fmt_ms, fmt_x
from benchmark.llm import render_fsdp
from benchmark.targets import issue11_targets


def _targets_rows(targets: list[dict[str, Any]]) -> list[str]:
    """A table of goals: each target, its measured figure, its goal, and whether it was met."""
    rows = ["| target | measured | goal | met |", "|---|---|---|---|"]
    for t in targets:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        rows.append(f"| {t['target']} | {t['measured']} | {t['goal']} | {met} |")
    return rows + [""]


def render_markdown(res: dict[str, Any]) -> str:
    """The report of a run (``res``: the JSON's dict) as markdown."""
    m = res["machine"]
    L: list[str] = []
    L.append("# Checkpoint benchmark\n")
    g = m.get("gpu") or {}
    gpu_text = (
        f"CUDA {g.get('torch_cuda')}, {g['name']} ({g['memory_bytes'] / GiB:.0f} GiB)"
        if g.get("name")
        else "CUDA"
        if m["cuda"]
        else "CPU only"
    )
    L.append(
        f"{m['date']} | {m['cpu_count']} CPUs ({m['cpu_model']}), torch {m['torch']} "
        f"({gpu_text}), Python {m['python']}, {m['ram_gib']:.0f} GiB RAM, "
        f"{m['platform']}; directory on {m['fs']}; asyncckpt {m['asyncckpt']} (git {m.get('git_head', '?')}, "
        f"sources sha1 {m.get('asyncckpt_sources_sha1', '?')}); load average "
        f"{m['loadavg_start'][0]:.1f} at start, "
        + (f"{m['loadavg_end'][0]:.1f} at end" if "loadavg_end" in m else "the run stopped before its end")
        + " (a shared machine)\n"
    )
    if res.get("partial"):
        L.append("**Partial**: the run was stopped (a time limit) before its end; what it finished is below.\n")
    if res.get("no_gpu"):
        L.append(f"## GPU rows (--device cuda)\n\n{res['no_gpu']}: nothing measured.\n")
        L.append(f"Total benchmark time: {res['total_s'] / 60:.1f} min.\n")
        return "\n".join(L)
    L.append(
        f"Medians of {res['args']['reps']} saves after a first (cold) one "
        f"({res['args']['big_reps']} for states >= 2 GiB, {res['args'].get('llm_reps', res['args']['reps'])} "
        f"on llm and fsdp2; {res['args'].get('load_reps', res['args']['reps'])} loads per method); the trainer "
        "mutates its state after every "
        "stall. **stall**: the training thread blocked until the state may be mutated; **returns**: "
        "the save call returned (for overlapped/asynchronous staging, before the copy is done); "
        "**committed**: durable (fsynced) and committed, from the call (torch.save: written + fsync), "
        "compared with the mean of the raw writes + fsyncs of the same bytes into the same directory made "
        "right before and right after the system's saves (the disk's speed drifts); **GB/s**: state bytes / "
        "committed; **peak extra**: peak over all saves of the resident memory of this process and its "
        "children (private memory summed, shared memory counted once) minus the baseline before the system "
        "was set up (workers included), as a multiple of the state bytes; "
        "**extra after #1 / last**: the same after the first and the last commit (flat = no leak). "
        "Loads start from a cold page cache (posix_fadvise DONTNEED on the fsynced files; no root for "
        "drop_caches) and load in place into the same state dict.\n"
    )
    if res.get("skipped"):
        L.append("Skipped: " + "; ".join(res["skipped"]) + "\n")
    on_gpu = res.get("device") == "cuda"
    limit_name = "D2H copy into pinned memory" if on_gpu else "memcpy"
    for w in res["workloads"]:
        lim = w["limits"]
        gib = w["bytes"] / GiB
        L.append(f"## {w['name']}: {w['label']}, {gib:.3f} GiB ({w['bytes'] / 1e6:.1f} MB)\n")
        rw = lim.get("raw_write_fsync_all_s") or [lim["raw_write_fsync_s"]]
        L.append(
            f"Limits: memcpy {fmt_ms(lim['memcpy_s'])} ms ({w['bytes'] / lim['memcpy_s'] / 1e9:.2f} GB/s; best of "
            f"{len(lim.get('memcpy_all_s', [0]))}, before and after the systems), "
            f"raw write+fsync {fmt_ms(lim['raw_write_fsync_s'])} ms "
            f"({w['bytes'] / lim['raw_write_fsync_s'] / 1e9:.2f} GB/s; median of {len(rw)}, before, between and "
            f"after the systems, range {fmt_ms(min(rw))}-{fmt_ms(max(rw))} ms), raw read "
            f"{fmt_ms(lim['raw_read_cold_s'])} ms cold / {fmt_ms(lim['raw_read_warm_s'])} ms warm. "
            f"Saves per system: {w['saves']}"
            + (
                f" (the first, {w['warmup']} warm-up saves, then the {w['saves'] - 1 - w['warmup']} measured)"
                if w.get("warmup")
                else ""
            )
            + ".\n"
        )
        L.append(
            "| system | stall (ms) | stall / memcpy | first stall (ms) | returns (ms) | committed (ms) | "
            "committed / raw write around it | GB/s | peak extra | extra after #1 / last (MiB) |"
        )
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        L.append(f"| *{limit_name} (limit)* | {fmt_ms(lim['memcpy_s'])} | 1.00x | | | | | | | |")
        L.append(
            f"| *raw write + fsync (limit)* | | | | | {fmt_ms(lim['raw_write_fsync_s'])} | 1.00x | "
            f"{w['bytes'] / lim['raw_write_fsync_s'] / 1e9:.2f} | | |"
        )
        for name, s in w["systems"].items():
            L.append(
                f"| {name} | {fmt_ms(s['stall_s'])} | {fmt_x(s['stall_s'] / lim['memcpy_s'])} | "
                f"{fmt_ms(s['first_stall_s'])} | {fmt_ms(s['returns_s'])} | {fmt_ms(s['committed_s'])} | "
                f"{fmt_x(committed_ratio(s, lim))} | {s['gbps']:.2f} | "
                f"{s['peak_extra_ratio']:.2f}x | {s['extra_after_first_bytes'] / MiB:.0f} / "
                f"{s['extra_after_last_bytes'] / MiB:.0f} |"
            )
        for name, error in (w.get("failed") or {}).items():
            L.append(f"| {name} | failed: {error} | | | | | | | | |")
        polled = [(name, s) for name, s in w["systems"].items() if s.get("maybe_finalize_calls")]
        if polled:
            L.append(
                "\nThe training thread's time in asyncckpt's `maybe_finalize()`, called every 2 ms while "
                "the commit was pending (the commit runs in the finalizer thread): "
                + "; ".join(
                    f"{name}: median {fmt_ms(s['maybe_finalize_s'])} ms, max "
                    f"{fmt_ms(s['maybe_finalize_max_s'])} ms over {s['maybe_finalize_calls']} calls"
                    for name, s in polled
                )
                + "."
            )
        L += render_commit_vs_raw(w)
        L.append("")
        if w.get("loads"):
            raw = w["loads"]["raw read (cold cache)"]["s"]
            ref = w["loads"].get("dcp.load (dcp.save checkpoint)", {}).get("s")
            L.append("| load | time (ms) | / raw read (cold) | / dcp.load |")
            L.append("|---|---:|---:|---:|")
            for name, load in w["loads"].items():
                L.append(
                    f"| {name} | {fmt_ms(load['s'])} | {fmt_x(load['s'] / raw)} | "
                    f"{fmt_x(load['s'] / ref) if ref else ''} |"
                )
            L.append("")
        if w.get("techniques"):
            L.append(f"asyncckpt techniques one at a time ({w['name']}):\n")
            L.append("| variant | stall (ms) | mean stall (ms) | first stall (ms) | committed (ms) | peak extra |")
            L.append("|---|---:|---:|---:|---:|---:|")
            for name, t in w["techniques"].items():
                L.append(
                    f"| {name} | {fmt_ms(t['stall_s'])} | {fmt_ms(t.get('mean_stall_s'))} | "
                    f"{fmt_ms(t['first_stall_s'])} | {fmt_ms(t.get('committed_s'))} | "
                    f"{t['peak_extra_ratio']:.2f}x |"
                )
            L.append("")
    tr = res.get("training")
    if tr:
        c = tr["config"]
        ks = tr.get("every_list") or [tr["every"]] + [x["every"] for x in tr.get("sparser", [])]
        L.append(f"## Training loop: checkpoint every K = {', '.join(map(str, ks))} steps\n")
        label = tr.get("label") or (
            f"scripts/train.py's GPT ({c['n_layer']} layers, {c['n_head']} heads, width {c['n_embd']}, "
            f"context {c['block_size']}, batch {c['batch_size']}) + AdamW"
        )
        L.append(
            f"{label}; {tr['params'] / 1e6:.2f} M params, "
            f"state {tr['state_bytes'] / 1e6:.1f} MB; {tr['steps']} steps per run at K = {tr['every']} (at "
            f"least {tr.get('min_checkpoints', 0)} checkpoints per run: more steps at a sparser K, against "
            "no-checkpoint runs of the same length), median of "
            f"{res['args']['train_reps']} interleaved runs; the last save is committed inside the measured "
            "time. asyncckpt's manager is made and prepare()d before the loop, as in the quick start (its "
            "first save, planning and allocating, is in the first-save figures above). Overlapped: save after "
            "optimizer.step() of step t, forward/backward of step t+1, then wait "
            "for the staging before optimizer.step(). dcp.async_save waits for the previous save before the "
            "next. **blocked**: the training thread's time in save(), the staging wait and (asyncckpt) "
            "maybe_finalize(), per checkpoint; the rest of the slowdown is the background writer competing "
            "with training for the same cores (and, for DCP's thread executor, the GIL). "
            f"Calibration: step {fmt_ms(tr['calib_step_s'])} ms, torch.save+fsync "
            f"{fmt_ms(tr['calib_torch_save_s'])} ms, so K = {tr['auto_every']} makes torch.save cost >= 50 %"
            + (
                f"; get_state_dict() itself takes {fmt_ms(tr['state_dict_s'])} ms, inside every system's save()"
                if "state_dict_s" in tr
                else ""
            )
            + (
                ""
                if tr["torch_save_target_met"] or not tr.get("every_calibrated", True)
                else " (not reached in the measured runs)"
            )
            + ".\n"
        )
        for every, systems, n_steps in [(tr["every"], tr["systems"], None)] + [
            (x["every"], x["systems"], x.get("steps")) for x in tr.get("sparser", [])
        ]:
            if every != tr["every"]:
                L.append(
                    f"\nThe same with a checkpoint every K = {every} steps"
                    + (f" ({n_steps} steps per run)" if n_steps else "")
                    + ":\n"
                )
            L.append(
                "| system | time (s) | slowdown | blocked per checkpoint (ms) | in save() | in staging wait | "
                "in maybe_finalize() | final drain (ms) | checkpoints |"
            )
            L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
            for name, s in systems.items():
                parts = [
                    fmt_ms(s.get(f"blocked_{k}_per_save_s")) if s["saves"] else ""
                    for k in ("save", "staging_wait", "poll")
                ]
                L.append(
                    f"| {name} | {s['time_s']:.2f} | {100 * s['slowdown']:+.1f} % | "
                    f"{fmt_ms(s['blocked_per_save_s']) if s['saves'] else ''} | "
                    + " | ".join(parts)
                    + f" | {fmt_ms(s.get('drain_s')) if s['saves'] else ''} | {s['saves']} |"
                )
            for f in tr.get("failed", []):
                if f["every"] == every:
                    L.append(f"| {f['system']} | failed: {f['error']} | | | | | | | |")
        L.append("")
    if res.get("fsdp2"):
        L += render_fsdp(res["fsdp2"], res["args"].get("llm_reps", res["args"]["reps"]))
    # Ratios summary
    names = list(dict.fromkeys(n for w in res["workloads"] for n in w["systems"]))
    if names:
        wl = res["workloads"]
        head = "| system | " + " | ".join(w["name"] for w in wl) + " |"
        sep = "|---|" + "---:|" * len(wl)
        L.append("## Ratios summary\n")
        for title, ratio in (
            ("stall / memcpy", lambda s, lim: s["stall_s"] / lim["memcpy_s"]),
            ("committed / raw write+fsync (mean of the ones right before and after the system)", committed_ratio),
        ):
            L.append(f"{title}:\n")
            L.append(head)
            L.append(sep)
            for n in names:
                cells = [fmt_x(ratio(w["systems"][n], w["limits"])) if n in w["systems"] else "" for w in wl]
                L.append(f"| {n} | " + " | ".join(cells) + " |")
            L.append("")
        lnames = list(dict.fromkeys(n for w in wl for n in w.get("loads", {})))
        if lnames:
            L.append("load / raw read (cold), and / dcp.load of the dcp.save checkpoint:\n")
            L.append(head)
            L.append(sep)
            for n in lnames:
                cells = []
                for w in wl:
                    loads = w.get("loads", {})
                    if n not in loads:
                        cells.append("")
                        continue
                    ref = loads.get("dcp.load (dcp.save checkpoint)", {}).get("s")
                    cells.append(
                        fmt_x(loads[n]["s"] / loads["raw read (cold cache)"]["s"])
                        + (f" / {fmt_x(loads[n]['s'] / ref)}" if ref else "")
                    )
                L.append(f"| {n} | " + " | ".join(cells) + " |")
            L.append("")
    if tr:
        for every, systems in [(tr["every"], tr["systems"])] + [
            (x["every"], x["systems"]) for x in tr.get("sparser", [])
        ]:
            L.append(
                f"training-loop slowdown (checkpoint every {every} steps): "
                + ", ".join(f"{n} {100 * s['slowdown']:+.1f} %" for n, s in systems.items() if n != "no checkpoint")
                + "\n"
            )
    targets = res.get("targets") or issue11_targets(res)
    if targets:
        L.append("## Issue 11 targets\n")
        L.append(
            "Every figure of the issue's table, as measured in this run (asyncckpt: CheckpointManager, "
            "persistent worker, default options; DCP: dcp.async_save thread + a reused DefaultStager; memcpy: "
            "best of 6 copies of the same bytes into preallocated memory; raw write: the mean of the raw writes "
            "+ fsyncs right before and after the system's saves; raw read: cold page cache).\n"
        )
        L.extend(_targets_rows(targets))
    gpu_targets = res.get("gpu_targets")
    if gpu_targets:
        L.append("## Issue 35 targets (GPU)\n")
        L.append(
            "The goals of issue 35's GPU rows, as measured in this run (asyncckpt: CheckpointManager, persistent "
            "worker; the D2H copy: best of 6 non-blocking copies of the same tensors into pinned memory).\n"
        )
        L.extend(_targets_rows(gpu_targets))
    if res.get("export_md"):
        L.append("## Export to Hugging Face safetensors\n")
        L.append(res["export_md"] + "\n")
    if res.get("lightning_md"):
        L.append("## Lightning checkpoints\n")
        L.append(res["lightning_md"] + "\n")
    if "total_s" in res:
        L.append(f"Total benchmark time: {res['total_s'] / 60:.1f} min.\n")
    return "\n".join(L)


def render_commit_vs_raw(w: dict[str, Any]) -> list[str]:
    """Markdown lines of a workload whose raw writes + fsyncs ran between the measured
    saves (the ``sizes`` workloads): each system's commit against them; none for
    another workload."""
    rows = [(name, s) for name, s in w["systems"].items() if "interleaved_s" in s]
    if not rows:
        return []
    n_raw = len(rows[0][1]["interleaved_all_s"])
    what = f"{w['distinct_sizes']} distinct record sizes" if w.get("distinct_sizes") else w["name"]
    L = [
        (
            f"\nCommit with {what} against the raw write + fsync of the same bytes, measured after each "
            f"measured save (median of {n_raw}; medians of the saves after the first and "
            f"{w.get('warmup', 0)} warm-up saves). asyncckpt's own phases: **writer** (checksums, writes and "
            "fsyncs of its data files), **commit** (metadata, manifest, rename), **until committed** "
            "(from the `save()` call):\n"
        ),
        (
            "| system | writer (ms) | commit (ms) | until committed (ms) | raw write+fsync (ms) | writer / raw | "
            "until committed / raw |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in rows:
        raw = s["interleaved_s"]
        writer = s.get("write_s")
        L.append(
            f"| {name} | {fmt_ms(writer)} | {fmt_ms(s.get('finalize_s'))} | {fmt_ms(s['committed_s'])} | "
            f"{fmt_ms(raw)} | {fmt_x(writer / raw) if writer is not None else ''} | "
            f"{fmt_x(s['committed_s'] / raw)} |"
        )
    return L

"""Side-by-side checkpoint benchmark: asyncckpt against torch.save, DCP and the physical limits.

One command measures, in one run, on the same state dicts and in the same directory:

workloads  synthetic float32 state dicts (256 MiB and 1 GiB in 16 tensors, 1 GiB in 4096
           tensors; 4G/16 on request), ``sizes200`` (200 tensors of 200 distinct sizes
           between 64 KiB and 1 MiB: the commit with many record sizes, against raw
           write + fsync of the same bytes between its saves), the training example's
           model + AdamW state (scripts/train.py), and LLM-shaped states: ``llm``, a GPT
           whose parameters + AdamW state are ~1 GiB in 1172 tensors from get_state_dict,
           and ``fsdp2``, the same model under FSDP2 on 2 ranks (DTensor shards)
systems    torch.save (+ fsync), dcp.save, dcp.async_save (thread and process executors,
           each with DCP's default staging and with a reused DefaultStager), asyncckpt
           synchronous, temporal, persistent, persistent with overlapped staging, and
           persistent with prepare() before the first save; on llm and fsdp2 only
           dcp.async_save thread + DefaultStager and asyncckpt persistent (with and
           without prepare()), side by side; on sizes200 the first two
limits     memcpy of the same bytes into a preallocated buffer, raw sequential write +
           fsync and raw read of the same bytes in the same directory

Per system (medians over --reps saves after a first, cold, one that is reported apart):
stall (training thread blocked until the state may be mutated), committed (until durable),
write GB/s, peak extra memory (PSS of the process tree over the baseline before the
system was set up, sampled by a separate process) and the extra memory after the first
and the last save; load times (asyncckpt.load with and without verify, dcp.load,
torch.load) against a raw read, all from a cold page cache (posix_fadvise DONTNEED);
asyncckpt's techniques one at a time (buffer reuse, copy / write threads, plan cache,
staging buffers); the slowdown of the training example's loop with a checkpoint every
K = 1, 4 and 16 steps against no checkpoint; and, at the end, "Issue 11 targets": every
figure of issue 11's table as measured in this run, its goal and whether it is met.

``bench.py local-tier [--mb N] [--workload uniform|llm]``: the node-local tier's rows
instead (:mod:`benchmark.local_tier`: save stall, local and peer restore, training at
K = 1, each against its limit), the same as ``scripts/bench_local_tier.py``.

``bench.py stall-tail [--saves N] [--mb N]``: the stall's tail over many saves of the
LLM-shaped state (median, p99, longest, memcpy) and the garbage collections inside the
saves, per tier (:mod:`benchmark.stall_tail`).

``bench.py shard-index [--ranks 4,32,128]``: what a rank of a sharded load reads and
parses to find its chunks, ``.metadata`` against the shard index, by world size
(:mod:`benchmark.shard_index`).

    python scripts/bench.py                       # everything (about 25-30 min here)
    python scripts/bench.py --workloads llm,fsdp2 --no-train --techniques ""
    python scripts/bench.py --workloads 1G/16     # one workload
    python scripts/bench.py --workloads sizes200 --no-train --lightning-mb 0 --techniques ""
    python scripts/bench.py --quick               # smoke run (< 60 s)
    python scripts/bench.py --device cuda         # issue 35's GPU rows (no GPU: says so, exits 0)

On a GPU (``--device cuda``, the default where torch sees one) the states live in device
memory: the llm workload (24 blocks of width 1024 unless --llm-config) against the D2H
copy into pinned memory, with asyncckpt overlapped and DCP with a DefaultStager per save
beside the usual systems, and issue 35's training loop (``--train-model mlp``) at K = 1,
4, 10; an "Issue 35 targets" table; a system that fails is a row with its error.

Output: markdown on stdout (and --md), JSON (--json), a PNG chart (--png).

The modules, one concern each: ``workloads`` (the state dicts), ``llm`` (the LLM and
FSDP2 workloads), ``systems`` (the systems under test), ``limits`` (memcpy, raw write
and read), ``harness`` (timing a system's saves, the loads, the techniques),
``training`` (the training loop), ``memory`` (the memory sampler), ``report``,
``figures``, ``targets`` and ``chart`` (markdown, issue 11's table, the PNG),
``machine`` (what a run records of the machine), ``gpu`` (the device, the GPU loop's model),
``cli`` (the command line and the run).
"""

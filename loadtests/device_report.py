"""`baton bench device`'s readable table (the figures: `device_bench`)."""

from __future__ import annotations

from baton_serve.loadtests.peer_play import BATON, LLAMA_SERVER, comparison_lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1e3 * value:.1f}"


def _gbs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _memory(rows: list[dict]) -> str:
    return ", ".join(
        f"{r['device']} {(r['total_bytes'] - r['free_bytes']) / 2**30:.2f} of "
        f"{r['total_bytes'] / 2**30:.2f} GiB used"
        for r in rows
    )


def format_report(result: dict) -> str:
    """The figures of one `device_benchmark` run as text."""
    decode = result["decode"]
    memory = result["device_memory"]
    lines = [
        f"model: {result['model']} ({result['model_kind']})",
        f"device: {result['device']} (n_gpu_layers {result['n_gpu_layers']}, n_ctx "
        f"{result['n_ctx']}, {result['threads']} CPU thread(s), CPU backend "
        f"{result['cpu_backend']})",
    ]
    if "exact_reuse" in result:  # runs before 2026-11-29 did not record it
        attention = {True: "on", False: "off", None: "llama.cpp's auto"}[result["flash_attn"]]
        lines.append(f"engine: exact_reuse {result['exact_reuse']}, flash attention {attention}")
    if memory["loaded"]:
        lines.append(f"device memory: before {_memory(memory['before'])}")
        lines.append(
            f"  engines loaded: {_memory(memory['loaded'])}; end: {_memory(memory['end'])}"
        )
    else:
        lines.append("device memory: llama.cpp names no GPU device")
    lines.append(
        "decode (from the first token to the last stream's end, warm: prompts not in it;"
        " a decode step's llama_decode call, logits read back included, and sampling):"
    )
    for count in decode["streams"]:
        key = str(count)
        speedup = decode["speedup"].get(key)
        step = decode["step"][key]
        lines.append(
            f"  {count:>3} stream(s): {decode['tokens_per_s'][key]:8.1f} tok/s"
            + (f" ({speedup:.2f}x one stream)" if speedup is not None else "")
            + f"; step: call {step['decode_call_ms']:.2f} ms, sampling {step['sample_ms']:.2f} ms"
        )
    lines += [
        f"per context ({result['repeats']} repeats; TTFT p50/p95/p99 in ms; cached = the same "
        "prompt plus 64 new tokens: resident, the slot holding the prompt (rewound KB: any "
        "partial state loaded, never attention KV), and from host memory, its full state "
        "restored (ckpt MB)):",
        f"{'context':>7} {'prefill tok/s':>13} {'TTFT cold':>20} {'TTFT cached':>20}"
        f" {'rewound KB':>10} {'TTFT from host':>20} {'ckpt MB':>8} {'save GB/s':>9}"
        f" {'restore GB/s':>12}",
    ]
    for row in result["contexts"]:
        cold, cached, restored = row["ttft_cold_s"], row["ttft_cached_s"], row["ttft_restored_s"]
        lines.append(
            f"{row['context']:>7} {row['prefill_tokens_per_s']:>13.0f}"
            f" {'/'.join(_ms(cold[p]) for p in ('p50', 'p95', 'p99')):>20}"
            f" {'/'.join(_ms(cached[p]) for p in ('p50', 'p95', 'p99')):>20}"
            f" {row['rewound_bytes'] / 1e3:>10.1f}"
            f" {'/'.join(_ms(restored[p]) for p in ('p50', 'p95', 'p99')):>20}"
            f" {row['checkpoint_bytes'] / 1e6:>8.2f} {_gbs(row['save_gb_per_s']):>9}"
            f" {_gbs(row['restore_gb_per_s']):>12}"
        )
    lines += [
        "ship engine A -> engine B on this device (the signed wire blob: export, import with"
        " every check, restore; NOT the network transport, which bench ship measures):",
        f"{'context':>7} {'tokens':>7} {'blob MB':>8} {'export ms':>9} {'import ms':>9}"
        f" {'restore ms':>10} {'GB/s':>7} {'B TTFT ms':>9}  continuation",
    ]
    for row in result["contexts"]:
        ship = row["ship"]
        same = "equals A's" if ship["continuation_matches"] else "DIFFERS from A's"
        lines.append(
            f"{row['context']:>7} {ship['tokens']:>7} {ship['blob_bytes'] / 1e6:>8.2f}"
            f" {_ms(ship['export_s']):>9} {_ms(ship['import_s']):>9}"
            f" {_ms(ship['restore_s']):>10} {_gbs(ship['gb_per_s']):>7}"
            f" {_ms(ship['ttft_on_b_s']):>9}  {len(ship['continuation'])} tokens, {same}"
        )
    lines.append(
        "save GB/s: a finished conversation's full state, stored once the engine is idle"
        " (never while other streams wait on a step)"
    )
    if "peer" in result:
        lines += _peer_lines(result)
    if "peer_chat" in result:
        lines += _chat_lines(result["peer_chat"])
    return "\n".join(lines)


def _chat_lines(chat: dict) -> list[str]:
    """The multi-turn workload: the engine alone beside llama-server."""
    workload, engine = chat["workload"], chat["engine"]
    requests = chat[BATON]["requests"]
    lines = [
        f"bench peer's multi-turn workload ({requests} requests, {workload['concurrency']} at a"
        f" time): Baton's engine alone (no Ray, no gateway) beside llama-server, each with"
        f" {engine['n_slots']} slots, {engine['n_threads']} threads, n_gpu_layers"
        f" {engine['n_gpu_layers']}:",
        *comparison_lines(chat["rows"]),
    ]
    for side in (LLAMA_SERVER, BATON):
        summary = chat[side]
        lines.append(
            f"  {side}: {summary['prompt_tokens']} prompt tokens, {summary['cached_tokens']}"
            f" cached, {summary['errors']} errors, {summary['wall_s']:.1f} s"
        )
    return lines


def _peer_lines(result: dict) -> list[str]:
    """Baton's engine beside llama-batched-bench: aggregate decode and prefill tok/s."""
    peer, decode = result["peer"], result["decode"]
    lines = [
        f"beside llama.cpp's {peer['tool']} (same model, device, threads and attention;"
        " Baton / llama.cpp, target >= 1.0x):",
        f"{'streams':>7} {'Baton decode tok/s':>18} {'llama.cpp':>10} {'ratio':>6}",
    ]
    for count in decode["streams"]:
        ours, theirs = decode["tokens_per_s"][str(count)], peer["decode_tokens_per_s"][str(count)]
        lines.append(f"{count:>7} {ours:>18.1f} {theirs:>10.1f} {ours / theirs:>5.2f}x")
    lines.append(f"{'context':>7} {'Baton prefill tok/s':>19} {'llama.cpp':>10} {'ratio':>6}")
    for row in result["contexts"]:
        ours = row["prefill_tokens_per_s"]
        theirs = peer["prefill_tokens_per_s"][str(row["cold_prompt_tokens"])]
        lines.append(f"{row['context']:>7} {ours:>19.0f} {theirs:>10.0f} {ours / theirs:>5.2f}x")
    return lines

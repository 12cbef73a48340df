"""The GPU path's measurements in one run (issue 47), no weights to stage: synthetic targets.

Run first when a GPU machine is at hand (``python3 scripts/gpu/static_path.py --out $OUT``,
about 5-8 minutes on an H200); check it on CPU before (``--smoke``: tiny shapes, eager only, a
few seconds; tests/test_gpu_scripts.py runs it). Everything goes to ``--out``:

- ``static-path.json`` / ``static-path.md``: per bucket (rows x tokens) step times of the static
  pass eager, as one CUDA graph per bucket, and under ``torch.compile(mode="reduce-overhead")``
  (a few buckets: each shape compiles); the profiler's kernels per step and host vs device time;
  Hugging Face's eager step on the same weights; the Llama-3.1-8B-shaped step against its
  bandwidth floor (weights + KV read once, at the copy bandwidth measured in the same run); and
  speculative rows (n-gram drafts, and the plain output's own continuation, corrupted every
  third round) checked token for token against plain decoding on the device.
- ``headline-gpu.json`` (CUDA runs; ``headline-cpu-smoke.json`` from a CPU check): the
  ``gpu_*`` figures the issue names, for ``--import-from`` to merge on the development machine.
- ``log.txt``.

Each section is time-boxed by ``--budget-s`` and fails alone (its error goes into the results),
so one broken mode never costs the rest of a lease.

    python3 scripts/gpu/static_path.py --out OUT [--real-target DIR] [--budget-s 480]
    python scripts/gpu/static_path.py --smoke --out /tmp/static-smoke
    python scripts/gpu/static_path.py --import-from RESULTS [--label gpu-h200]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from builder.headline import update_headline
from triton_backend.core.synthetic_target import SyntheticSpec, parse_target, synthetic_tensors, weight_bytes
from triton_backend.engines.batch import BatchRow
from triton_backend.engines.torch.cuda_graphs import PassMode, PassRunner
from triton_backend.engines.torch.llama_forward import LlamaForward
from triton_backend.engines.torch.static_decode import BucketPolicy, StaticDecoder, device_dtype
from triton_backend.speculation.device_verify import greedy_accept

logger = logging.getLogger("static_path")
REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


@dataclass
class Settings:
    out: Path
    device: str
    target: str = "synthetic:smollm2-135m"
    big_target: str = "synthetic:llama-3.1-8b"
    real_target: str = ""
    rows: tuple[int, ...] = (1, 4, 16, 32)
    tokens: tuple[int, ...] = (1, 4, 8, 16)
    modes: tuple[str, ...] = ("eager", "graph", "compile")
    compile_buckets: tuple[tuple[int, int], ...] = ((1, 1), (16, 1), (1, 16))
    context: int = 256
    max_context: int = 1024
    repeats: int = 20
    spec_rows: int = 4
    spec_new: int = 64
    draft_len: int = 4
    budget_s: float = 480.0
    tiny: bool = False
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    started: float = field(default_factory=time.time)

    def left(self) -> float:
        return self.budget_s - (time.time() - self.started)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _spec(target: str, settings: Settings, seed: int) -> SyntheticSpec:
    spec = parse_target(target, seed=seed)
    return SyntheticSpec(spec.name, seed, layers=2, vocab=256, tiny=True) if settings.tiny else spec


def _decoder(config, tensors, settings: Settings, slots: int) -> StaticDecoder:
    quantum = 16 if settings.tiny else 256
    return StaticDecoder(LlamaForward(config, tensors, None), slots, settings.max_context, BucketPolicy(context_quantum=quantum))


def _prefill(decoder: StaticDecoder, slots: list[int], length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, decoder.fwd.shape.vocab_size, (length,), generator=gen).tolist() for _ in slots]
    for i in range(0, len(slots), 8):
        with torch.no_grad():
            decoder.run([BatchRow(s, 0, p) for s, p in zip(slots[i:i + 8], prompts[i:i + 8])])
    return prompts


def _time(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median-free mean over ``repeats`` back-to-back calls, ms (the GPU queue drained at both ends)."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / repeats


def _step_rows(slots: list[int], rows: int, tokens: int, start: int) -> list[BatchRow]:
    return [BatchRow(s, start, [(7 * i + j) % 200 + 1 for j in range(tokens)]) for i, s in enumerate(slots[:rows])]


def bandwidth(device: torch.device, tiny: bool) -> dict:
    """Device memory bandwidth from a large copy (reads + writes), GB/s."""
    n = (16 if tiny else 2048) * 2**20
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    ms = _time(lambda: b.copy_(a), device, 5 if tiny else 20)
    return {"bytes": n, "copy_ms": ms, "gb_per_s": 2 * n / (ms * 1e-3) / 1e9}


def bucket_times(decoder: StaticDecoder, slots: list[int], settings: Settings, results: dict,
                 modes: tuple[str, ...]) -> None:
    table = results.setdefault("buckets", [])
    for mode in modes:
        if settings.left() < 60:
            results.setdefault("skipped", []).append(f"bucket times {mode}: out of budget")
            continue
        try:
            runner = PassRunner(decoder, mode)
        except ValueError as exc:
            results.setdefault("unavailable", {})[mode] = str(exc)
            continue
        for rows in settings.rows:
            for tokens in settings.tokens:
                if mode == "compile" and (rows, tokens) not in settings.compile_buckets:
                    continue
                if rows > len(slots) or settings.left() < (120 if mode == "compile" else 30):
                    continue  # a compilation takes a minute or two
                bucket, inputs = decoder.prepare(_step_rows(slots, rows, tokens, settings.context))
                entry = {"mode": mode, "rows": rows, "tokens": tokens, "context": bucket.context}
                try:
                    first = time.perf_counter()
                    runner(bucket, inputs)
                    _sync(decoder.device)
                    entry["first_call_s"] = time.perf_counter() - first  # capture / compilation included
                    entry["step_ms"] = _time(lambda: runner(bucket, inputs), decoder.device, settings.repeats)
                    entry["prepare_ms"] = _time(lambda: decoder.prepare(_step_rows(slots, rows, tokens, settings.context)),
                                                decoder.device, 5)
                except Exception as exc:  # a mode that fails on this stack is a finding, not the end of the run
                    logger.exception("bucket %s %dx%d failed", mode, rows, tokens)
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:400]
                table.append(entry)
                logger.info("bucket %s", entry)


def profile(decoder: StaticDecoder, slots: list[int], settings: Settings, results: dict, modes: tuple[str, ...]) -> None:
    """Kernels per 1x1 step, host time to issue it, device time the kernels take, per mode."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    out = results.setdefault("profile", {})
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if decoder.device.type == "cuda" else [])
    for mode in modes:
        if settings.left() < 30:
            break
        try:
            runner = PassRunner(decoder, mode)
            bucket, inputs = decoder.prepare(_step_rows(slots, 1, 1, settings.context))
            runner(bucket, inputs)
            _sync(decoder.device)
            steps = 5
            with torch_profile(activities=activities) as prof:
                started = time.perf_counter()
                for _ in range(steps):
                    runner(bucket, inputs)
                issued = time.perf_counter() - started
                _sync(decoder.device)
                done = time.perf_counter() - started
            kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
            device_us = sum(getattr(e, "device_time", getattr(e, "cuda_time", 0.0)) for e in kernels)
            out[mode] = {"kernels_per_step": len(kernels) / steps, "host_issue_ms": issued * 1e3 / steps,
                         "device_busy_ms": device_us / 1e3 / steps, "wall_ms": done * 1e3 / steps,
                         "cpu_ops_per_step": sum(1 for e in prof.events() if e.device_type.name == "CPU") / steps}
            if decoder.device.type == "cuda" and mode == "eager":
                out[mode]["host_syncs_in_pass"] = _sync_check(lambda: runner(bucket, inputs))
        except ValueError as exc:
            out[mode] = {"unavailable": str(exc)}
        except Exception as exc:
            logger.exception("profile %s failed", mode)
            out[mode] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        logger.info("profile %s: %s", mode, out[mode])


def _sync_check(call: Callable[[], object]) -> str:
    """``none`` when ``call`` runs with CUDA's sync debug mode set to error, else the error."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
        return "none"
    except RuntimeError as exc:
        return f"{exc}"[:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)


def hf_step(config, tensors, settings: Settings, device: torch.device, dtype: torch.dtype, results: dict) -> None:
    """Hugging Face's eager decode step, 1 row, same weights and context: the reference cost."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    missing = model.load_state_dict(tensors, strict=False, assign=True).missing_keys  # the tensors, not copies
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    if set(missing) - {"lm_head.weight"}:
        raise ValueError(f"Hugging Face's model misses {sorted(missing)[:4]}")
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config, device=device)  # its buffers were meta
    model.eval()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (1, settings.context), generator=gen).to(device)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)

        def step():
            nonlocal past, token
            o = model(token, past_key_values=past, use_cache=True)
            past, token = o.past_key_values, o.logits[:, -1:].argmax(-1)

        step()
        results["hf"] = {"step_ms": _time(step, device, settings.repeats), "rows": 1, "context": settings.context}
    logger.info("hf %s", results["hf"])


def big_step(settings: Settings, device: torch.device, dtype: torch.dtype, results: dict, bw: float) -> None:
    """The 8B-shaped step (1 row) against its floor: weights and the KV it reads, once, at copy bandwidth."""
    config, tensors = synthetic_tensors(_spec(settings.big_target, settings, 1), device, dtype)
    decoder = _decoder(config, tensors, settings, 2)
    slots = [decoder.allocate()]
    _prefill(decoder, slots, settings.context, 1)
    shape = decoder.shape
    entry: dict = {"target": settings.big_target, "weight_bytes": weight_bytes(tensors)}
    for mode in ("eager", "graph"):
        try:
            runner = PassRunner(decoder, mode)
        except ValueError as exc:
            entry[f"{mode}_unavailable"] = str(exc)
            continue
        for tokens in (1, 16):
            bucket, inputs = decoder.prepare(_step_rows(slots, 1, tokens, settings.context))
            runner(bucket, inputs)
            entry[f"{mode}_1x{tokens}_ms"] = _time(lambda: runner(bucket, inputs), device, max(3, settings.repeats // 2))
        kv = 2 * shape.num_layers * shape.num_kv_heads * bucket.context * shape.head_dim * decoder.cache.keys.element_size()
        entry.update(kv_bytes=kv, context=bucket.context)
    best = min(v for k, v in entry.items() if k.endswith("_1x1_ms"))
    entry["floor_ms"] = (entry["weight_bytes"] + entry["kv_bytes"]) / (bw * 1e9) * 1e3
    entry["step_x_floor"] = best / entry["floor_ms"]
    results["big"] = entry
    logger.info("8B-shaped %s", entry)
    del decoder, tensors
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _ngram_drafts(history: list[int], k: int, n: int = 2) -> list[int]:
    """Prompt lookup: the tokens after the latest earlier occurrence of the last ``n`` tokens."""
    tail = history[-n:]
    for i in range(len(history) - n - 1, -1, -1):
        if history[i:i + n] == tail:
            return history[i + n:i + n + k]
    return []


def speculative_check(decoder: StaticDecoder, runner: PassRunner, settings: Settings, label: str, results: dict) -> None:
    """Plain greedy decoding of ``spec_rows`` rows, then the same rows speculatively (device
    acceptance, one [R, 2] copy per round) with n-gram drafts and with oracle drafts (plain's own
    continuation, the last draft corrupted every third round): each row must equal plain."""
    slots = [decoder.allocate() for _ in range(settings.spec_rows)]
    prompts = _prefill(decoder, slots, 32, 11)
    new, k = settings.spec_new, settings.draft_len

    def plain() -> list[list[int]]:
        out = [[] for _ in slots]
        last = [p[-1] for p in prompts]
        # re-run the last prompt token (its position is rewritten with the same values)
        for step in range(new):
            rows = [BatchRow(s, 31 + step, [last[i]]) for i, s in enumerate(slots)]
            bucket, inputs = decoder.prepare(rows)
            nxt = runner(bucket, inputs)[:len(rows), 0].argmax(-1).cpu().tolist()
            for i, t in enumerate(nxt):
                out[i].append(t)
                last[i] = t
        return out

    def speculative(drafter: Callable[[int, list[int], int], list[int]]) -> tuple[list[list[int]], int]:
        out: list[list[int]] = [[] for _ in slots]
        passes = rounds = 0
        while any(len(o) < new for o in out):
            live = [i for i, o in enumerate(out) if len(o) < new]
            drafts = {i: drafter(i, prompts[i] + out[i], rounds)[:max(0, min(k, new - len(out[i]) - 1))] for i in live}
            rows = [BatchRow(slots[i], 31 + len(out[i]), [(prompts[i] + out[i])[-1]] + drafts[i]) for i in live]
            bucket, inputs = decoder.prepare(rows)
            logits = runner(bucket, inputs)[:len(rows)]
            kk = bucket.tokens - 1
            padded = torch.zeros(len(rows), kk, dtype=torch.long)
            for j, i in enumerate(live):
                padded[j, :len(drafts[i])] = torch.tensor(drafts[i], dtype=torch.long)
            num = torch.tensor([len(drafts[i]) for i in live])
            result = greedy_accept(logits, padded.to(logits.device), num.to(logits.device)).cpu().tolist()
            for j, i in enumerate(live):
                m, nxt = result[j]
                out[i].extend(drafts[i][:m] + [nxt])
            passes += 1
            rounds += 1
        return [o[:new] for o in out], passes

    started = time.perf_counter()
    reference = plain()
    plain_s = time.perf_counter() - started
    entry: dict = {"rows": len(slots), "new_tokens": new, "draft_len": k, "plain_s": plain_s}

    def oracle(i: int, history: list[int], rnd: int) -> list[int]:
        done = len(history) - len(prompts[i])
        drafts = list(reference[i][done:done + k])
        if drafts and rnd % 3 == 2:
            drafts[-1] = (drafts[-1] + 1) % decoder.fwd.shape.vocab_size
        return drafts

    for name, drafter in (("ngram", lambda i, h, r: _ngram_drafts(h, k)), ("oracle", oracle)):
        started = time.perf_counter()
        got, passes = speculative(drafter)
        seconds = time.perf_counter() - started
        same = [g == r for g, r in zip(got, reference)]
        entry[name] = {"identical_rows": sum(same), "target_passes": passes, "seconds": seconds,
                       "tokens_per_pass": new / passes, "x_plain": plain_s / seconds,
                       "first_difference": next(([i, next(j for j, (a, b) in enumerate(zip(g, r)) if a != b)]
                                                 for i, (g, r) in enumerate(zip(got, reference)) if g != r), None)}
    for s in slots:
        decoder.release(s)
    results.setdefault("speculative", {})[label] = entry
    logger.info("speculative %s: %s", label, entry)


def _best(results: dict, rows: int, tokens: int, mode: str | None = None) -> tuple[float, str] | None:
    found = [(b["step_ms"], b["mode"]) for b in results.get("buckets", [])
             if b["rows"] == rows and b["tokens"] == tokens and "step_ms" in b and mode in (None, b["mode"])]
    return min(found) if found else None


def headline(results: dict) -> dict[str, float]:
    """The issue's figures, every ratio within one mode: the one with the fastest 1 x 1 step."""
    figures: dict[str, float] = {}
    fastest = _best(results, 1, 1)
    mode = fastest[1] if fastest else None
    results["headline_mode"] = mode
    one, verify16, rows16 = (_best(results, r, t, mode) for r, t in ((1, 1), (1, 16), (16, 1)))
    if one:
        figures["gpu_plain_step_ms"] = one[0]
        if "hf" in results:
            figures["gpu_engine_plain_decode_x_hf"] = results["hf"]["step_ms"] / one[0]
        if verify16:
            figures["gpu_verify_16_tokens_x_step"] = verify16[0] / one[0]
        if rows16:
            figures["gpu_decode_throughput_16_over_1"] = 16 * one[0] / rows16[0]
    if "big" in results and "step_x_floor" in results["big"]:
        figures["gpu_8b_step_x_bandwidth_floor"] = results["big"]["step_x_floor"]
    return figures


def _markdown(results: dict, figures: dict) -> str:
    lines = [f"# Static GPU path ({results['env'].get('device_name', results['env']['device'])}), "
             "written by scripts/gpu/static_path.py", "",
             "Synthetic targets (shipped configs, seeded random weights): costs, not acceptance.", "",
             "| mode | rows | tokens | context | step ms | first call s |", "|---|---|---|---|---|---|"]
    for b in results.get("buckets", []):
        cell = f"{b['step_ms']:.3f}" if "step_ms" in b else b.get("error", "-")[:60]
        lines.append(f"| {b['mode']} | {b['rows']} | {b['tokens']} | {b['context']} | {cell} | "
                     f"{b.get('first_call_s', 0):.2f} |")
    lines += ["", "Profile of a 1x1 step: " + json.dumps(results.get("profile", {})), "",
              f"Headline figures (mode {results.get('headline_mode')}): " + json.dumps({k: round(v, 4) for k, v in figures.items()}), "",
              "Speculative rows vs plain: " + json.dumps(results.get("speculative", {}))]
    return "\n".join(lines) + "\n"


def small_target(settings: Settings, device: torch.device, dtype: torch.dtype, results: dict,
                 section: Callable[[str, Callable[[], None], float], None]) -> None:
    """The 135M-shaped target: bucket times, profile, Hugging Face's step, speculative rows."""
    config, tensors = synthetic_tensors(_spec(settings.target, settings, 0), device, dtype)
    decoder = _decoder(config, tensors, settings, max(max(settings.rows), settings.spec_rows))
    slots = [decoder.allocate() for _ in range(max(settings.rows))]
    _prefill(decoder, slots, settings.context, 0)
    modes = tuple(m for m in settings.modes if m != "compile")  # compile last: its compilations take minutes
    section("buckets", lambda: bucket_times(decoder, slots, settings, results, modes), 60)
    section("expand_kv", lambda: expanded_kv(decoder, slots, settings, results, _spec_mode(device)), 30)
    section("profile", lambda: profile(decoder, slots, settings, results, modes), 30)
    section("hf", lambda: hf_step(config, tensors, settings, device, dtype, results), 30)
    for s in slots:
        decoder.release(s)
    section("speculative", lambda: speculative_check(decoder, PassRunner(decoder, _spec_mode(device)), settings,
                                                     settings.target, results), 30)
    if dtype != torch.float32:  # the same rows in float32 too: exactness apart from bf16's shape-dependent rounding
        def float32_rows() -> None:
            cfg, weights = synthetic_tensors(_spec(settings.target, settings, 0), device, torch.float32)
            dec = _decoder(cfg, weights, settings, settings.spec_rows)
            speculative_check(dec, PassRunner(dec, _spec_mode(device)), settings, settings.target + ":float32", results)
        section("speculative_float32", float32_rows, 30)


def expanded_kv(decoder: StaticDecoder, slots: list[int], settings: Settings, results: dict, mode: str) -> None:
    """A few buckets again with keys/values repeated per query head before SDPA (its fused kernels
    where their GQA support is missing), rows marked ``+expand_kv``."""
    keep = settings.rows, settings.tokens
    settings.rows, settings.tokens = tuple(r for r in (1, 16) if r in keep[0]), tuple(t for t in (1, 16) if t in keep[1])
    decoder.expand_kv = True
    try:
        before = len(results.get("buckets", []))
        bucket_times(decoder, slots, settings, results, (mode,))
        for entry in results["buckets"][before:]:
            entry["mode"] += "+expand_kv"
    finally:
        decoder.expand_kv = False
        settings.rows, settings.tokens = keep


def compiled_target(settings: Settings, device: torch.device, dtype: torch.dtype, results: dict) -> None:
    """``torch.compile`` on the 135M-shaped target (rebuilt: same seed, same weights), last in the
    run: a few buckets, each shape one compilation, then its profile."""
    config, tensors = synthetic_tensors(_spec(settings.target, settings, 0), device, dtype)
    decoder = _decoder(config, tensors, settings, max(max(settings.rows), settings.spec_rows))
    slots = [decoder.allocate() for _ in range(max(settings.rows))]
    _prefill(decoder, slots, settings.context, 0)
    bucket_times(decoder, slots, settings, results, ("compile",))
    profile(decoder, slots, settings, results, ("compile",))


def real_target(settings: Settings, device: torch.device, dtype: torch.dtype, results: dict) -> None:
    """Speculative rows on staged real weights (a Hugging Face folder), in the device's precision."""
    from triton_backend.engines.torch.llama_forward import load_safetensors_weights

    config, weights = load_safetensors_weights(settings.real_target, dtype)
    decoder = _decoder(config, {k: v.to(device) for k, v in weights.items()}, settings, settings.spec_rows)
    speculative_check(decoder, PassRunner(decoder, _spec_mode(device)), settings,
                      "real:" + Path(settings.real_target).name, results)


def _spec_mode(device: torch.device) -> str:
    return "graph" if device.type == "cuda" else "eager"


def run(settings: Settings) -> dict:
    settings.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(settings.device)
    dtype = device_dtype(device, settings.dtype)
    env = {"device": str(device), "dtype": str(dtype), "torch": torch.__version__, "smoke": settings.tiny}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    results: dict = {"env": env, "settings": {k: (str(v) if isinstance(v, Path) else v)
                                              for k, v in asdict(settings).items()}}

    def section(name: str, fn: Callable[[], None], need_s: float) -> None:
        if settings.left() < need_s:
            results.setdefault("skipped", []).append(f"{name}: out of budget")
            return
        started = time.time()
        try:
            fn()
        except Exception as exc:
            logger.exception("section %s failed", name)
            results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:400]
        results.setdefault("section_s", {})[name] = round(time.time() - started, 1)

    bw = bandwidth(device, settings.tiny)
    results["bandwidth"] = bw
    small_target(settings, device, dtype, results, section)  # its weights, cache and graphs freed on return
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if settings.real_target:
        section("real", lambda: real_target(settings, device, dtype, results), 60)
    section("big", lambda: big_step(settings, device, dtype, results, bw["gb_per_s"]), 60)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "compile" in settings.modes:
        section("compile", lambda: compiled_target(settings, device, dtype, results), 120)
    figures = headline(results)
    results["headline"] = figures
    (settings.out / "static-path.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (settings.out / "static-path.md").write_text(_markdown(results, figures))
    if figures:
        name = "headline-gpu.json" if device.type == "cuda" and not settings.tiny else "headline-cpu-smoke.json"
        update_headline(figures, settings.out / name)
    return results


def import_results(results_dir: Path, label: str) -> None:
    """On the development machine: the run's files into benchmarks/results, its gpu_* figures
    into headline.json (only a CUDA run's, and only keys the README's headline table has a row for)."""
    data = json.loads((results_dir / "static-path.json").read_text())
    if data["env"]["device"].split(":")[0] != "cuda" or data["env"].get("smoke"):
        raise SystemExit("not a CUDA run: nothing to import")
    for suffix in ("json", "md"):
        shutil.copy(results_dir / f"static-path.{suffix}", RESULTS / f"static-path-{label}.{suffix}")
    from builder.bench.docs_render import HEADLINE_ROWS

    known = {row.key for row in HEADLINE_ROWS}  # the README's table renders only keys it has a row for
    figures = {k: v for k, v in json.loads((results_dir / "headline-gpu.json").read_text()).items() if k.startswith("gpu_")}
    update_headline({k: v for k, v in figures.items() if k in known}, RESULTS / "headline.json")
    unknown = sorted(set(figures) - known)
    if unknown:
        logger.warning("kept in static-path-%s.json only (no row in builder/bench/docs_render.py yet): %s", label,
                       ", ".join(unknown))
    print(json.dumps(figures))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, eager only: the check before a lease")
    p.add_argument("--target", default="synthetic:smollm2-135m")
    p.add_argument("--big-target", default="synthetic:llama-3.1-8b")
    p.add_argument("--real-target", default="", help="a staged Hugging Face folder (speculative check on real weights)")
    p.add_argument("--rows", default="1,4,16,32")
    p.add_argument("--tokens", default="1,4,8,16")
    p.add_argument("--modes", default="eager,graph,compile")
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="weights and KV cache (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--import-from", type=Path, default=None)
    p.add_argument("--label", default="gpu-h200")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.import_from:
        import_results(args.import_from, args.label)
        return
    if args.out is None:
        p.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    logging.getLogger().addHandler(logging.FileHandler(args.out / "log.txt"))
    settings = Settings(args.out, args.device, args.target, args.big_target, args.real_target, _ints(args.rows),
                        _ints(args.tokens), tuple(m for m in args.modes.split(",") if m), budget_s=args.budget_s,
                        dtype=args.dtype)
    if args.smoke:
        settings.device, settings.tiny, settings.modes = "cpu", True, ("eager", "graph", "compile")
        settings.dtype = settings.dtype or "bfloat16"  # the GPU precision's code path, and the float32 rows beside it
        settings.rows, settings.tokens = (1, 16), (1, 16)
        settings.context, settings.max_context, settings.repeats = 24, 128, 2
        settings.spec_rows, settings.spec_new = 2, 16
    for mode in settings.modes:
        PassMode(mode)
    results = run(settings)
    print(json.dumps({"headline": results["headline"], "errors": results.get("errors", {}),
                      "skipped": results.get("skipped", [])}))


if __name__ == "__main__":
    main()

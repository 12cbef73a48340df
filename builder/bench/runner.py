"""Runs every row on the same prompts and weights, interleaved so noise hits all rows alike."""

from __future__ import annotations

import logging
import platform
import random

import torch
from tqdm import tqdm

from builder.bench.config import BenchConfig, BenchRun
from builder.bench.rows import OursRow, PeerRow, Row, run_sample
from triton_backend.config import RuntimeConfig, SpeculationConfig, SpeculationMode
from triton_backend.deployment import DeploymentConfig, build_decoder
from triton_backend.generation import SpeculativeDecoder
from triton_backend.model_loading import load_model

logger = logging.getLogger(__name__)


def build_rows(config: BenchConfig, decoder: SpeculativeDecoder) -> list[Row]:
    rows: list[Row] = [OursRow("plain", decoder, SpeculationConfig(mode=SpeculationMode.OFF), {"kind": "ours", "method": "off"})]
    for k in config.ngram_k:
        rows.append(OursRow(f"ngram k={k}", decoder, SpeculationConfig(mode=SpeculationMode.NGRAM, num_draft_tokens=k),
                            {"kind": "ours", "method": "ngram", "k": k}))
    if SpeculationMode.DRAFT in decoder.drafters:
        for k in config.draft_k:
            rows.append(OursRow(f"draft k={k}", decoder, SpeculationConfig(mode=SpeculationMode.DRAFT, num_draft_tokens=k),
                                {"kind": "ours", "method": "draft", "k": k}))
    medusa = getattr(SpeculationMode, "MEDUSA", None)
    if medusa is not None and medusa in decoder.drafters:
        rows.append(OursRow("medusa", decoder, SpeculationConfig(mode=medusa), {"kind": "ours", "method": "medusa"}))
    if config.peer:
        model = decoder.target.model
        rows.append(PeerRow("hf plain", model, {}, {"kind": "peer", "method": "off"}))
        rows.append(PeerRow("hf prompt-lookup", model, {"prompt_lookup_num_tokens": 10},
                            {"kind": "peer", "method": "ngram", "k": 10}))
        if config.draft is not None:
            assistant = load_model(config.draft, RuntimeConfig(num_threads=config.num_threads)).eval()
            rows.append(PeerRow("hf assisted", model, {"assistant_model": assistant}, {"kind": "peer", "method": "draft"}))
    return rows


def _deployment(config: BenchConfig) -> DeploymentConfig:
    fields = {"target": config.target, "draft": config.draft, "runtime": RuntimeConfig(num_threads=config.num_threads)}
    if config.medusa is not None and "medusa" in DeploymentConfig.__dataclass_fields__:
        fields["medusa"] = config.medusa
    return DeploymentConfig(**fields)


def run_bench(config: BenchConfig) -> BenchRun:
    decoder = build_decoder(_deployment(config))
    tokenizer = decoder.tokenizer
    prompts = config.load_prompts()
    encoded = {
        w: [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in ps]
        for w, ps in prompts.items()
    }
    encoded_ids = {w: [decoder.encode(p) for p in ps] for w, ps in encoded.items()}
    rows = build_rows(config, decoder)
    run = BenchRun(config=config, rows=[r.name for r in rows], row_info={r.name: r.info for r in rows})
    run.environment = {
        "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "device": decoder.target.runtime.device, "label": config.label,
    }
    first = next(iter(encoded_ids.values()))[0]
    for row in rows:  # warm-up, not recorded
        row.run(first, 8)
    order_rng = random.Random(0)
    jobs = [(rep, w, i) for rep in range(config.repeats) for w in encoded_ids for i in range(len(encoded_ids[w]))]
    with tqdm(total=len(jobs) * len(rows), desc="bench", unit="req") as bar:
        for rep, workload, index in jobs:
            shuffled = list(rows)
            order_rng.shuffle(shuffled)  # no row always runs first (cache/thermal order effects)
            for row in shuffled:
                ids = encoded_ids[workload][index]
                run.samples.append(run_sample(row, workload, index, rep, ids, config.max_tokens))
                bar.update(1)
    return run

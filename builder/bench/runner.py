"""Runs every row on the same prompts and weights, interleaved so noise hits all rows alike."""

from __future__ import annotations

import logging
import platform
import random

import torch
from tqdm import tqdm

import contextlib
import dataclasses
import tempfile
from pathlib import Path
from typing import Iterator

from builder.bench.config import BenchConfig, BenchPrompt, BenchRun
from builder.bench.rows import OursRow, PeerRow, Row, TritonRow, run_sample
from triton_backend.core.config import (DraftLengthConfig, EagleConfig, FallbackConfig, SpeculationConfig,
                                        SpeculationMode)
from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.deployment.torch_deployment import build_decoder
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.engines.torch.model_loading import load_model

logger = logging.getLogger(__name__)


def _plain_and_ngram_rows(config: BenchConfig, decoder: SpeculativeDecoder, suffix: str = "",
                          **info: object) -> list[Row]:
    rows: list[Row] = [OursRow(f"plain{suffix}", decoder, SpeculationConfig(method=SpeculationMode.OFF),
                               {"kind": "ours", "method": "off", **info})]
    for k in config.ngram_k:
        rows.append(OursRow(f"ngram k={k}{suffix}", decoder,
                            SpeculationConfig(method=SpeculationMode.NGRAM,
                                              draft_length=DraftLengthConfig(num_draft_tokens=k)),
                            {"kind": "ours", "method": "ngram", "k": k, "strategy": "chain", **info}))
    return rows


MODEL_DRAFTERS = (SpeculationMode.EAGLE, SpeculationMode.DRAFT, SpeculationMode.MEDUSA)


def auto_row(config: BenchConfig, decoder: SpeculativeDecoder) -> list[Row]:
    """``auto``: per round the n-gram match, the model drafter (the deployment's first of
    EAGLE, draft model, Medusa) or, with EAGLE trees, both merged into one tree, beside the rows
    that draft from one source; ``auto_unmerged``: also the row without merged trees."""
    model = next((m for m in MODEL_DRAFTERS if m in decoder.drafters), None)
    if not config.auto or model is None or SpeculationMode.NGRAM not in decoder.drafters:
        return []
    k = config.auto_k or max(config.ngram_k, default=4)
    length = DraftLengthConfig(num_draft_tokens=k)
    info = {"kind": "ours", "method": "auto", "k": k, "strategy": "auto", "model_drafter": model.value}
    rows: list[Row] = [OursRow("auto", decoder, SpeculationConfig(method=SpeculationMode.AUTO, draft_length=length),
                               {**info, "merge_lookup": model is SpeculationMode.EAGLE})]
    if config.auto_unmerged and model is SpeculationMode.EAGLE:
        rows.append(OursRow("auto unmerged", decoder,
                            SpeculationConfig(method=SpeculationMode.AUTO, draft_length=length,
                                              eagle=EagleConfig(merge_lookup=False)), {**info, "merge_lookup": False}))
    return rows


def eagle_rows(config: BenchConfig, decoder: SpeculativeDecoder) -> list[Row]:
    """Per draft length: the EAGLE chain row and, beside it, the dynamic tree row (trees of at
    most ``eagle_tree_nodes`` nodes sized each round by the gain rule; none when 0). Each row names
    the drafter (path in the repository) and its format (EAGLE-1 or EAGLE-3, read from its files)."""
    from builder.train.eagle_job import drafter_identity

    rows: list[Row] = []
    named: dict[str, str] = {}
    if config.eagle is not None:
        identity = drafter_identity(config.eagle)
        named = {"drafter": identity["drafter"], "eagle_format": identity["format"]}
    for k in config.eagle_k:
        length = DraftLengthConfig(num_draft_tokens=k)
        rows.append(OursRow(f"eagle k={k}", decoder, SpeculationConfig(method=SpeculationMode.EAGLE, draft_length=length,
                                                                       eagle=EagleConfig(tree=False)),
                            {"kind": "ours", "method": "eagle", "k": k, "strategy": "chain", **named}))
        if config.eagle_tree_nodes > 0:
            tree = EagleConfig(tree=True, max_tree_nodes=config.eagle_tree_nodes)
            rows.append(OursRow(f"eagle tree k={k}", decoder, SpeculationConfig(method=SpeculationMode.EAGLE,
                                                                                draft_length=length, eagle=tree),
                                {"kind": "ours", "method": "eagle", "k": k, "strategy": "tree",
                                 "max_tree_nodes": tree.max_tree_nodes, **named}))
    if config.eagle_always_tree is not None:  # the same tree every round: no pause, no sizing
        depth, nodes = config.eagle_always_tree
        rows.append(OursRow(f"eagle tree {depth}x{nodes} always", decoder, SpeculationConfig(
            method=SpeculationMode.EAGLE, draft_length=DraftLengthConfig(num_draft_tokens=depth),
            fallback=FallbackConfig(enabled=False), eagle=EagleConfig(tree=True, max_tree_nodes=nodes)),
            {"kind": "ours", "method": "eagle", "k": depth, "strategy": "tree-always", "max_tree_nodes": nodes, **named}))
    return rows


def build_rows(config: BenchConfig, decoder: SpeculativeDecoder) -> list[Row]:
    rows = _plain_and_ngram_rows(config, decoder)
    if SpeculationMode.DRAFT in decoder.drafters:
        for k in config.draft_k:
            rows.append(OursRow(f"draft k<={k} adaptive", decoder,
                                SpeculationConfig(method=SpeculationMode.DRAFT,
                                                  draft_length=DraftLengthConfig(num_draft_tokens=k, adaptive=True)),
                                {"kind": "ours", "method": "draft", "k": k, "strategy": "chain"}))
    medusa = getattr(SpeculationMode, "MEDUSA", None)
    if medusa is not None and medusa in decoder.drafters:
        rows.append(OursRow("medusa", decoder, SpeculationConfig(method=medusa), {"kind": "ours", "method": "medusa", "strategy": "tree"}))
    if SpeculationMode.EAGLE in decoder.drafters:
        rows += eagle_rows(config, decoder)
    rows += auto_row(config, decoder)
    if config.self_draft:
        from builder.bench.self_draft import self_draft_rows

        rows += self_draft_rows(config, decoder)
    if config.peer and config.target_weights is not WeightPrecision.FLOAT32:
        logger.info("no Hugging Face rows: they would run float32 weights beside a %s target", config.target_weights.value)
    elif config.peer:
        # the peer runs stock transformers: its own copy of the same weights (load_model never
        # prepacks; only our TorchEngine does)
        model = load_model(config.target, RuntimeConfig(num_threads=config.num_threads)).eval()
        threads = max(config.num_threads, getattr(decoder.target, "threads", 1))  # as many CPU threads as ours
        rows.append(PeerRow("hf plain", model, {}, {"kind": "peer", "method": "off"}, threads))
        rows.append(PeerRow("hf prompt-lookup", model, {"prompt_lookup_num_tokens": 10},
                            {"kind": "peer", "method": "ngram", "k": 10}, threads))
        if config.draft is not None:
            assistant = load_model(config.draft, RuntimeConfig(num_threads=config.num_threads)).eval()
            rows.append(PeerRow("hf assisted", model, {"assistant_model": assistant}, {"kind": "peer", "method": "draft"},
                                threads))
    return rows


@contextlib.contextmanager
def triton_rows(config: BenchConfig, deployment: DeploymentConfig) -> Iterator[list[Row]]:
    """A real Triton server on loopback serving the same deployment, and its rows."""
    if not config.triton:
        yield []
        return
    from builder.stages.model_repository import render_model_repository
    from triton_backend.serving.launch.triton_server import ServerConfig, TritonServer
    from triton_backend.serving.interface import ServingConfig

    with tempfile.TemporaryDirectory(prefix="specbuild-bench-") as work:
        repository = render_model_repository(deployment, Path(work) / "model_repo", ServingConfig(max_concurrency=1))
        with TritonServer(ServerConfig(repository, exit_timeout_s=10, log_file=Path(work) / "triton.log")) as server:
            assert server.endpoints is not None
            url = server.endpoints.grpc_url
            k = config.ngram_k[0]
            yield [TritonRow("plain via triton", url, "off", None, {"kind": "triton", "method": "off", "twin": "plain"}),
                   TritonRow(f"ngram k={k} via triton", url, "ngram", k,
                             {"kind": "triton", "method": "ngram", "k": k, "twin": f"ngram k={k}"})]


def _deployment(config: BenchConfig) -> DeploymentConfig:
    def absolute(path: str | None) -> str | None:  # the served deployment resolves relative paths from its own folder
        return str(Path(path).resolve()) if path is not None and Path(path).exists() else path

    fields = {"target": absolute(config.target), "draft": absolute(config.draft),
              "runtime": RuntimeConfig(num_threads=config.num_threads, device=config.device, weights=config.target_weights)}
    if config.eagle is not None:
        fields["eagle"] = absolute(config.eagle)
    if config.medusa is not None:
        fields["medusa"] = absolute(config.medusa)
        if config.medusa_tree_size is not None:  # the file's tree cut to its first nodes (sorted by depth)
            from triton_backend.speculation.drafters.medusa_model import load_medusa

            fields["medusa_choices"] = tuple(load_medusa(config.medusa).heads.info.medusa_choices[:config.medusa_tree_size])
    return DeploymentConfig(**fields)


def run_bench(config: BenchConfig) -> BenchRun:
    deployment = _deployment(config)
    decoder = build_decoder(deployment)
    with triton_rows(config, deployment) as served:
        return _run_rows(config, decoder, build_rows(config, decoder) + unpacked_rows(config, deployment) + served)


def unpacked_rows(config: BenchConfig, deployment: DeploymentConfig) -> list[Row]:
    """The same runtime on torch's own kernels (no row-invariant kernel, no prepacked linear layers;
    plain and n-gram rows): the kernels' effect, side by side. Its own copy of the target; outputs
    are checked against plain like every row."""
    if not config.compare_unpacked:
        return []
    runtime = dataclasses.replace(deployment.runtime, packed_gemm_rows=0, row_kernel=False)
    decoder = build_decoder(DeploymentConfig(target=deployment.target, runtime=runtime))
    return _plain_and_ngram_rows(config, decoder, " unpacked", packed=False)


def _run_rows(config: BenchConfig, decoder: SpeculativeDecoder, rows: list[Row]) -> BenchRun:
    tokenizer = decoder.tokenizer
    prompts: list[BenchPrompt] = []
    for workload, texts in config.load_prompts().items():
        for index, text in enumerate(texts):
            messages = text if isinstance(text, list) else [{"role": "user", "content": text}]  # a conversation or one turn
            templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompts.append(BenchPrompt(workload, index, templated, decoder.encode(templated)))
    run = BenchRun(config=config, rows=[r.name for r in rows], row_info={r.name: r.info for r in rows})
    run.environment = {
        "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(), "torch": torch.__version__, "threads": getattr(decoder.target, "threads", torch.get_num_threads()),
        "device": decoder.target.runtime.device, "label": config.label,
    }
    for row in rows:  # warm-up, not recorded
        row.run(prompts[0], 8, config.ignore_eos)
    order_rng = random.Random(0)
    jobs = [(rep, prompt) for rep in range(config.repeats) for prompt in prompts]
    with tqdm(total=len(jobs) * len(rows), desc="bench", unit="req") as bar:
        for rep, prompt in jobs:
            shuffled = list(rows)
            order_rng.shuffle(shuffled)  # no row always runs first (cache/thermal order effects)
            for row in shuffled:
                run.samples.append(run_sample(row, prompt, rep, config.max_tokens, config.ignore_eos, tokenizer))
                bar.update(1)
    return run

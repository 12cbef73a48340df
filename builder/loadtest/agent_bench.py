"""The agent benchmark (issue 46): multi-turn tool-using conversations through the OpenAI API.

Every conversation of ``benchmarks/agent/conversations.json`` shares one long system prompt and
one set of tool definitions (over 1,500 tokens once the front renders them). Each turn appends a
staff request, the agent's tool call and the tool's result to the history, and the model under
test writes the answer (streamed, greedy, ``tool_choice: auto``); its answer joins the history
(a call it makes itself is answered with the file's ``unanswered_call_result``). Conversations
run concurrently, each on its own client thread, through the official ``openai`` SDK against a
real Triton server and the OpenAI front (:mod:`triton_backend.serving.front.openai`).

Arms, each on a fresh server (nothing cached from another arm), one warm-up request first (the
system prompt, the tools and a greeting: the state of a server that has served this agent
before):

- ``full``: prefix cache on, chunked prefill (``chunk_tokens`` per round), speculation ``auto``;
- ``cache_chunk``: the same server, speculation ``off``;
- ``spec``: prefix cache off, prefill in one round (``max_seq_len`` per round), ``auto``;
- ``plain``: all three off.

Per arm: time to first token (TTFT) per turn, the run's output tokens per second (completion
tokens of every turn over the wall time of the concurrent run), prefix-cache hits and reused
tokens (the server's metrics). Every arm's answers must equal the plain arm's, token for token
(greedy: caching, chunking and speculation change no output); an arm that differs or fails is
reported (``identical``: false, the script's exit status 1). Headline ``agent_bench_x_plain``:
``full``'s output tokens per second over ``plain``'s, with ``agent_bench_ttft_x_plain`` (median
TTFT, ``full`` over ``plain``), written only when both arms ran without error and ``full``'s answers
equal ``plain``'s.
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from builder.headline import HEADLINE_PATH, update_headline
from builder.report_paths import portable, repo_path
from triton_backend.core.errors import ConfigError

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
CONVERSATIONS = ROOT / "benchmarks" / "agent" / "conversations.json"
RESULTS = ROOT / "benchmarks" / "results"
WARMUP_USER = "Hello, are you ready to help with today's support queue?"


@dataclass(frozen=True)
class Arm:
    """One server setting and the speculation every request asks for."""

    name: str
    prefix_cache: bool
    chunked_prefill: bool
    speculation: str  # the request's ``speculation``: ``auto`` or ``off``


ARMS = {arm.name: arm for arm in (Arm("full", True, True, "auto"), Arm("cache_chunk", True, True, "off"),
                                   Arm("spec", False, False, "auto"), Arm("plain", False, False, "off"))}


@dataclass(frozen=True)
class AgentBenchConfig:
    conversations_file: Path = CONVERSATIONS
    conversations: int = 2  # the first N conversations of the file, run concurrently
    turns: int = 3  # the first N turns of each
    max_tokens: int = 48  # per answer
    arms: tuple[str, ...] = ("plain", "full", "cache_chunk", "spec")
    max_seq_len: int = 4096  # the conversations grow past the default 2,048 positions
    chunk_tokens: int = 512  # the served default: prompt tokens one round prefills, chunked arms
    kernel_threads: int = 1  # a loaded 2-core host: helper threads that spin would measure the load
    request_timeout_s: float = 1800.0
    label: str = "cpu"
    out: Path = RESULTS
    headline: Path | None = HEADLINE_PATH

    def __post_init__(self) -> None:
        unknown = sorted(set(self.arms) - set(ARMS))
        if unknown or not self.arms:
            raise ConfigError(f"arms must be among {sorted(ARMS)}, got {list(self.arms)}")
        for name in ("conversations", "turns", "max_tokens", "max_seq_len", "chunk_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.kernel_threads < 0:
            raise ConfigError(f"kernel_threads must be >= 0, got {self.kernel_threads}")


@dataclass
class TurnResult:
    conversation: str
    turn: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    text: str  # the answer's content, then its tool calls as JSON: what must match across arms
    target_passes: int | None = None


@dataclass
class ArmResult:
    arm: Arm
    wall_s: float
    turns: list[TurnResult] = field(default_factory=list)
    warmup_s: float = 0.0
    cache_counters: dict[str, float] = field(default_factory=dict)  # the prefix cache's, over the run
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ttfts = [t.ttft_s for t in self.turns]
        tokens = sum(t.completion_tokens for t in self.turns)
        later = [t.ttft_s for t in self.turns if t.turn > 0]
        passes = [t.target_passes for t in self.turns if t.target_passes is not None]
        return {"arm": self.arm.name, **{k: v for k, v in asdict(self.arm).items() if k != "name"},
                "turns": len(self.turns), "wall_s": self.wall_s, "completion_tokens": tokens,
                "prompt_tokens": sum(t.prompt_tokens for t in self.turns),
                "tokens_per_s": tokens / self.wall_s if self.wall_s > 0 else 0.0,
                "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
                "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
                "ttft_later_turns_p50_s": statistics.median(later) if later else None,
                "latency_p50_s": statistics.median([t.latency_s for t in self.turns]) if self.turns else None,
                "target_passes": sum(passes) if passes else None, "warmup_s": self.warmup_s,
                "cache_counters": self.cache_counters, "errors": self.errors}


def load_conversations(path: Path) -> dict[str, Any]:
    """The committed file, checked: a system prompt, tools, and conversations of turns that each carry
    a request, the agent's calls and one result per call."""
    data = json.loads(Path(path).read_text())
    for key in ("system", "tools", "conversations", "unanswered_call_result"):
        if key not in data:
            raise ConfigError(f"{path}: no {key!r}")
    for conv in data["conversations"]:
        for i, turn in enumerate(conv["turns"]):
            if len(turn["tool_calls"]) != len(turn["tool_results"]):
                raise ConfigError(f"{path}: {conv['name']} turn {i}: one result per tool call")
    return data


def turn_messages(turn: dict[str, Any]) -> list[dict[str, Any]]:
    """A turn's request, the agent's tool calls and their results, as OpenAI chat messages."""
    calls = [{"id": c["id"], "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in turn["tool_calls"]]
    results = [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(calls, turn["tool_results"])]
    return [{"role": "user", "content": turn["user"]}, {"role": "assistant", "content": None, "tool_calls": calls},
            *results]


def stream_answer(client: Any, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                  config: AgentBenchConfig, speculation: str) -> tuple[dict[str, Any], float, float, Any]:
    """One streamed answer: (assistant message, TTFT, latency, usage)."""
    started = time.perf_counter()
    ttft = None
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice="auto", max_tokens=config.max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"speculation": speculation})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            if (delta.content or delta.tool_calls) and ttft is None:
                ttft = time.perf_counter() - started
            if delta.content:
                content.append(delta.content)
            for call in delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                if call.function is not None:
                    slot["name"] += call.function.name or ""
                    slot["arguments"] += call.function.arguments or ""
    latency = time.perf_counter() - started
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for _, c in sorted(calls.items())]
    return message, latency if ttft is None else ttft, latency, usage


def run_conversation(client: Any, model: str, data: dict[str, Any], conv: dict[str, Any], config: AgentBenchConfig,
                     arm: Arm, out: list[TurnResult]) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": data["system"]}]
    for i, turn in enumerate(conv["turns"][:config.turns]):
        messages += turn_messages(turn)
        answer, ttft, latency, usage = stream_answer(client, model, messages, data["tools"], config, arm.speculation)
        spec = (usage.model_extra or {}).get("speculation") if usage is not None else None
        calls = [[c["function"]["name"], c["function"]["arguments"]] for c in answer.get("tool_calls", [])]
        text = answer["content"] + (json.dumps(calls) if calls else "")  # call ids are the server's own: left out
        out.append(TurnResult(conv["name"], i, ttft, latency, usage.prompt_tokens if usage else 0,
                              usage.completion_tokens if usage else 0, text,
                              spec.get("target_passes") if isinstance(spec, dict) else None))
        messages.append(answer)
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": data["unanswered_call_result"]}
                     for c in answer.get("tool_calls", [])]


def prefix_counters(metrics_url: str) -> dict[str, float]:
    """The server's prefix-cache counters (summed over models and instances)."""
    with urllib.request.urlopen(metrics_url, timeout=30) as reply:
        text = reply.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("specdec_prefix_cache_"):
            name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[-1]
            short = name.removeprefix("specdec_prefix_cache_").removesuffix("_total")
            found[short] = found.get(short, 0.0) + float(value)
    return found


def _servers(config: AgentBenchConfig, arm: Arm) -> tuple[Any, Any]:
    from builder.ops.default_deployment import default_deployment
    from triton_backend.serving.interface import ServingConfig

    deployment = default_deployment()
    deployment = replace(deployment, runtime=replace(deployment.runtime, max_seq_len=config.max_seq_len,
                                                     kernel_threads=config.kernel_threads))
    chunk = config.chunk_tokens if arm.chunked_prefill else config.max_seq_len
    serving = ServingConfig(prefix_cache=arm.prefix_cache, prefill_chunk_tokens=chunk,
                            max_batch_size=max(8, 2 * config.conversations), default_max_tokens=config.max_tokens)
    return deployment, serving


def run_arm(config: AgentBenchConfig, data: dict[str, Any], arm: Arm) -> ArmResult:
    """One arm on a fresh server: the warm-up request, then every conversation at once."""
    from openai import OpenAI

    from builder.ops.serve import start_openai_front
    from builder.stages.model_repository import render_model_repository
    from triton_backend.serving.front.openai.app import OpenAIConfig
    from triton_backend.serving.launch.triton_server import ServerConfig, TritonServer

    deployment, serving = _servers(config, arm)
    conversations = data["conversations"][:config.conversations]
    with tempfile.TemporaryDirectory(prefix="specbuild-agent-bench-") as tmp:
        repository = render_model_repository(deployment, Path(tmp) / "model_repo", serving)
        with TritonServer(ServerConfig(repository, exit_timeout_s=10, startup_timeout_s=600,
                                       log_file=Path(tmp) / "triton.log")) as server:
            front = start_openai_front(OpenAIConfig(), server.endpoints, repository)
            try:
                model = OpenAIConfig().model_id(front.backend)
                client = OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0,
                                timeout=config.request_timeout_s)
                started = time.perf_counter()
                warm = [{"role": "system", "content": data["system"]}, {"role": "user", "content": WARMUP_USER}]
                stream_answer(client, model, warm, data["tools"], replace(config, max_tokens=1), arm.speculation)
                result = ArmResult(arm, 0.0, warmup_s=time.perf_counter() - started)
                before = prefix_counters(server.endpoints.metrics_url)
                outs: list[list[TurnResult]] = [[] for _ in conversations]
                threads = [threading.Thread(target=_guarded, args=(result, run_conversation, client, model, data, conv,
                                                                   config, arm, outs[i]), daemon=True)
                           for i, conv in enumerate(conversations)]
                started = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                result.wall_s = time.perf_counter() - started
                after = prefix_counters(server.endpoints.metrics_url)
                result.cache_counters = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                result.turns = [t for out in outs for t in out]
            finally:
                front.stop()
    logger.info("arm %s: %s", arm.name, {k: v for k, v in result.summary().items() if k != "cache_counters"})
    return result


def _guarded(result: ArmResult, fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - a failed conversation is reported, the others go on
        logger.exception("conversation failed")
        result.errors.append(f"{type(exc).__name__}: {exc}")


def summarize(results: list[ArmResult], config: AgentBenchConfig, data: dict[str, Any]) -> dict[str, Any]:
    rows = [r.summary() for r in results]
    by_arm = {r.arm.name: r for r in results}
    reference = by_arm.get("plain") or results[0]
    want = {(t.conversation, t.turn): t.text for t in reference.turns}
    for row, r in zip(rows, results):
        got = {(t.conversation, t.turn): t.text for t in r.turns}
        row["identical_to_" + reference.arm.name] = got == want and not r.errors
    clean = all(row["identical_to_" + reference.arm.name] for row in rows)
    headline: dict[str, float] = {}
    same = {row["arm"]: row["identical_to_" + reference.arm.name] for row in rows}
    if "plain" in by_arm and same.get("full") and not by_arm["plain"].errors:
        full, plain = by_arm["full"].summary(), by_arm["plain"].summary()
        headline["agent_bench_x_plain"] = full["tokens_per_s"] / plain["tokens_per_s"]
        headline["agent_bench_ttft_x_plain"] = full["ttft_p50_s"] / plain["ttft_p50_s"]
    return {"config": portable({**asdict(config), "conversations_file": repo_path(config.conversations_file)}),
            "conversation_names": [c["name"] for c in data["conversations"][:config.conversations]],
            "rows": rows, "answers": {f"{t.conversation}/{t.turn}": t.text for t in reference.turns},
            "identical": clean, "headline": headline}


def to_markdown(summary: dict[str, Any]) -> str:
    c = summary["config"]
    lines = [f"Agent bench: {c['conversations']} concurrent conversations x {c['turns']} turns "
             f"({c['conversations_file']}), {c['max_tokens']} tokens per answer at most, greedy, tool_choice auto, "
             "through the OpenAI API (openai SDK) and a real Triton server; one fresh server per arm.", "",
             "| arm | prefix cache | chunked prefill | speculation | wall s | output tok/s | TTFT p50 s | "
             "TTFT later turns p50 s | cache reused tokens | same answers |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        same = next(v for k, v in r.items() if k.startswith("identical_to_"))
        lines.append(f"| {r['arm']} | {r['prefix_cache']} | {r['chunked_prefill']} | {r['speculation']} | "
                     f"{r['wall_s']:.1f} | {r['tokens_per_s']:.2f} | {r['ttft_p50_s']:.2f} | "
                     f"{_fmt(r['ttft_later_turns_p50_s'])} | {int(r['cache_counters'].get('reused_tokens', 0))} | {same} |")
    for r in summary["rows"]:
        lines += [f"\n{r['arm']}: a conversation failed: {error}" for error in r["errors"]]
    for key, value in summary["headline"].items():
        lines.append(f"\n{key}: {value:.3f}")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write_report(summary: dict[str, Any], config: AgentBenchConfig) -> dict[str, Path]:
    config.out.mkdir(parents=True, exist_ok=True)
    stem = config.out / f"agent-bench-{config.label}"
    paths = {"json": stem.with_suffix(".json"), "markdown": stem.with_suffix(".md")}
    paths["json"].write_text(json.dumps(portable(summary), indent=2) + "\n")
    paths["markdown"].write_text(to_markdown(summary) + "\n")
    if config.headline is not None and summary["headline"]:
        prefix = "" if config.label == "cpu" else f"{config.label}_"
        update_headline({prefix + k: v for k, v in summary["headline"].items()}, config.headline)
        paths["headline"] = config.headline
    return paths


def run_agent_bench(config: AgentBenchConfig) -> dict[str, Any]:
    data = load_conversations(config.conversations_file)
    results = [run_arm(config, data, ARMS[name]) for name in config.arms]
    summary = summarize(results, config, data)
    summary["paths"] = {k: repo_path(v) for k, v in write_report(summary, config).items()}
    return summary

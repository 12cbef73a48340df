"""Helpers for the trtllm runtime's tests, where TensorRT-LLM cannot run.

- :func:`write_engine_dir`: a folder laid out as ``trtllm-build --output_dir`` leaves it
  (``config.json`` in TensorRT-LLM's engine format, one ``rank<N>.engine`` per rank). The
  engine files hold no engine: they test the checks that run before TensorRT-LLM is needed.
- :class:`TorchRequestEngine`: the request contract the loop relies on (what TensorRT-LLM's
  Executor returns for a request built by :mod:`triton_backend.engines.trtllm.requests`),
  computed with the torch runtime, greedy only. It lets the loop of
  :mod:`triton_backend.speculation.trtllm_loop` run here; it says nothing about TensorRT-LLM itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from triton_backend.engines.torch.hf_engine import TorchEngine
from triton_backend.engines.trtllm.engine import EngineOutput
from triton_backend.engines.trtllm.requests import RequestSpec


def write_engine_dir(folder: Path, *, vocab: int = 49152, hidden: int = 576, layers: int = 30, tp: int = 1,
                     max_input_len: int = 1024, max_seq_len: int = 1280, max_draft_len: int = 4,
                     medusa_heads: int = 0, ranks_written: int | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    pretrained = {"architecture": "MedusaForCausalLM" if medusa_heads else "LlamaForCausalLM", "dtype": "float16",
                  "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
                  "num_attention_heads": 9, "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1}}
    if medusa_heads:
        pretrained["num_medusa_heads"] = medusa_heads
    build = {"max_batch_size": 4, "max_input_len": max_input_len, "max_seq_len": max_seq_len,
             "max_draft_len": max_draft_len, "max_beam_width": 1}
    (folder / "config.json").write_text(json.dumps({"version": "1.1.0", "pretrained_config": pretrained,
                                                    "build_config": build}))
    for rank in range(tp if ranks_written is None else ranks_written):
        (folder / f"rank{rank}.engine").write_bytes(b"not an engine")
    return folder


class TorchRequestEngine:
    """Answers engine requests as the Executor documents them, greedily, with a torch model:
    a request with draft tokens returns the accepted drafts plus one target token; one
    without returns up to ``max_tokens`` tokens; generation ends at ``end_id`` (which is
    returned). ``return_end_token=False`` models an engine that stops at the end token without
    returning it. ``requests`` records every request."""

    def __init__(self, engine: TorchEngine, name: str = "torch-contract", *, return_end_token: bool = True) -> None:
        self.engine = engine
        self.name = name
        self.return_end_token = return_end_token
        self.requests: list[RequestSpec] = []

    def _check(self, spec: RequestSpec) -> None:
        if spec.sampling.kwargs() != {"beam_width": 1, "top_k": 1}:
            raise NotImplementedError("the torch contract engine decodes greedily only")
        self.requests.append(spec)

    def _ended(self, token: int, spec: RequestSpec) -> bool:
        return spec.end_id >= 0 and token == spec.end_id

    def _tokens(self, spec: RequestSpec) -> Iterator[int]:
        session = self.engine.new_session()
        seq = list(spec.input_token_ids)
        if spec.draft is not None:
            drafts = list(spec.draft.tokens)
            argmax = session.logits(seq + drafts, len(drafts) + 1).argmax(-1).tolist()
            out: list[int] = []
            for i, token in enumerate(argmax):
                out.append(token)
                if self._ended(token, spec) or i == len(drafts) or token != drafts[i]:
                    break
            yield from out
            return
        for _ in range(spec.max_tokens):
            token = int(session.logits(seq, 1)[0].argmax())
            seq.append(token)
            yield token
            if self._ended(token, spec):
                return

    def generate(self, spec: RequestSpec) -> EngineOutput:
        self._check(spec)
        tokens = list(self._tokens(spec))
        if tokens and not self.return_end_token and self._ended(tokens[-1], spec):
            tokens.pop()
        return EngineOutput(tokens)

    def stream(self, spec: RequestSpec) -> Iterator[EngineOutput]:
        self._check(spec)
        for token in self._tokens(spec):
            if self._ended(token, spec) and not self.return_end_token:
                break
            yield EngineOutput([token], final=False)
        yield EngineOutput([], final=True)


def stand_in_trtllm_build(bin_dir: Path) -> Path:
    """An executable named trtllm-build that "compiles" as the real one leaves its output:
    ``config.json`` (engine format, from the checkpoint's config) and one ``rank<N>.engine``
    per rank, holding no engine. TensorRT-LLM cannot run here."""
    import stat
    import sys

    from builder.stages.compile import TRTLLM_BUILD

    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / TRTLLM_BUILD
    tool.write_text(f"#!{sys.executable}\n" + """\
import json, pathlib, sys
args = sys.argv[1:]
value = lambda flag, default=None: args[args.index(flag) + 1] if flag in args else default
ckpt = json.loads((pathlib.Path(value('--checkpoint_dir')) / 'config.json').read_text())
out = pathlib.Path(value('--output_dir'))
out.mkdir(parents=True, exist_ok=True)
build = {'max_batch_size': int(value('--max_batch_size')), 'max_input_len': int(value('--max_input_len')),
         'max_seq_len': int(value('--max_seq_len')), 'max_draft_len': int(value('--max_draft_len', 0))}
(out / 'config.json').write_text(json.dumps({'version': 'stand-in', 'pretrained_config': ckpt, 'build_config': build}))
mapping = ckpt.get('mapping', {})
for rank in range(mapping.get('tp_size', 1) * mapping.get('pp_size', 1)):
    (out / f'rank{rank}.engine').write_bytes(b'not an engine')
""")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return tool

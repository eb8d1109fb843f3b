"""`llm`: candidates written by a model behind any OpenAI-compatible chat endpoint
(vLLM, Ollama, llama.cpp server, a hosted API): POST {url}/chat/completions.

Each proposal is one call (the budget counts calls). The prompt holds the task (description,
signature, visible shapes, tolerance, the reference's and the baseline's source), the best
candidates so far with their speedups, and the last evaluator feedback (status, trimmed
error, timings). Held-out shapes and held-out results never enter a prompt. The answer's
first ```python block (or the whole answer if it has none but defines kernel) becomes the
candidate; an answer without code is recorded like any failed candidate, and its feedback
goes into the next prompt.

A reply that arrives but is unusable (not JSON, no choices[0].message, content that is not
text, no text at all, text that is not valid UTF-8, over MAX_REPLY_BYTES) is a rejected
proposal with the reason: the runner records it and goes on to the next call. Only a
transport failure (unreachable endpoint, an HTTP error status) stops the run, which the next
`wanka lab run` resumes.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import urllib.error
import urllib.request

from wanka.lab.proposers.base import Proposal, Proposer
from wanka.lab.store import Record
from wanka.lab.task import LabError, Task

SYSTEM = (
    "You optimise PyTorch operators. Reply with one complete Python file in a single "
    "```python block that defines kernel(...) with the exact signature given. It must be "
    "correct within the tolerance on any shape, including shapes you are not shown. Allowed "
    "imports: torch, math, triton, wanka.ops. No threads, processes, files, clocks, "
    "randomness, introspection or monkey-patching: the evaluator rejects them."
)
MAX_SOURCE = 8000  # characters of a previous candidate quoted in the prompt
MAX_ERROR = 1500
MAX_REPLY_BYTES = 8 << 20  # a larger HTTP body is not read further: the reply is rejected


class MalformedReply(LabError):
    """The endpoint answered, but with nothing usable: one proposal is rejected, the run
    goes on."""


def extract_code(answer: str) -> str | None:
    """The candidate file in a model's answer, or None."""
    if not isinstance(answer, str):
        return None
    blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", answer, flags=re.S)
    for b in blocks:
        if "def kernel" in b or "kernel" in b:
            return b.strip() + "\n"
    if "def kernel" in answer and "```" not in answer:
        return answer.strip() + "\n"
    return None


def build_prompt(task: Task, history: list[Record], n_best: int = 2) -> str:
    ref = task.reference_fn()
    try:
        ref_src = inspect.getsource(ref)
    except (OSError, TypeError):
        ref_src = f"# {task.reference}"
    shapes = "\n".join(f"- {s}" for s in task.shapes + (task.timing_shape,))
    parts = [
        f"# Task {task.name}\n{task.description}",
        f"Signature: {task.signature}\nDevice: {task.device}. Checked and timed: {task.mode}. "
        f"Tolerance: atol {task.tolerance.atol:g}, rtol {task.tolerance.rtol:g}.\n"
        f"Example shapes (others are used too):\n{shapes}",
        f"## Reference (definition of correct)\n```python\n{ref_src}```",
        f"## Baseline (starting point; speedup is measured against it)\n```python\n{task.baseline}```",
    ]
    best = sorted((r for r in history if r.correct and r.speedup), key=lambda r: -r.speedup)
    for r in best[:n_best]:
        parts.append(f"## Candidate #{r.n}: correct, {r.speedup:.2f}x the baseline "
                     f"({r.time_s * 1e3:.2f} ms)\n```python\n{r.source[:MAX_SOURCE]}```")  # fmt: skip
    if history:
        last = history[-1]
        text = last.feedback.summary()[:MAX_ERROR]
        times = last.feedback.details.get("times_s")
        if times:
            text += "\nrepeat times (ms): " + ", ".join(f"{t * 1e3:.2f}" for t in times)
        parts.append(f"## Feedback on your last candidate (#{last.n})\n{text}")
    parts.append("Write a faster correct kernel. Reply with the full file in one ```python block.")
    return "\n\n".join(parts)


class LLMProposer(Proposer):
    name = "llm"

    def __init__(self, url: str | None, model: str | None, api_key: str | None = None,
                 temperature: float = 0.2, timeout_s: float = 300.0):  # fmt: skip
        self.url = (url or os.environ.get("WANKA_LLM_URL") or os.environ.get("OPENAI_BASE_URL") or "").rstrip("/")  # fmt: skip
        self.model = model or os.environ.get("WANKA_LLM_MODEL") or ""
        self.key = (
            api_key or os.environ.get("WANKA_LLM_API_KEY") or os.environ.get("OPENAI_API_KEY")
        )
        if not self.url or not self.model:
            raise LabError("the llm proposer needs an endpoint and a model: --llm-url URL "
                           "--llm-model NAME (or WANKA_LLM_URL / WANKA_LLM_MODEL)")  # fmt: skip
        self.temperature, self.timeout_s = temperature, timeout_s
        self.max_reply_bytes = MAX_REPLY_BYTES

    def chat(self, messages: list[dict]) -> str:
        """The answer's text. LabError when the endpoint cannot be reached or answers an HTTP
        error; MalformedReply (a LabError) when it answers something unusable."""
        body = json.dumps({"model": self.model, "messages": messages,
                           "temperature": self.temperature}).encode()  # fmt: skip
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        req = urllib.request.Request(self.url + "/chat/completions", body, headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read(self.max_reply_bytes + 1)
        except urllib.error.HTTPError as e:
            detail = e.read(4096).decode(errors="replace")[:200].replace("\n", " ")
            raise LabError(f"LLM endpoint {self.url} answered HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise LabError(f"LLM endpoint {self.url} unreachable: {reason}") from None
        if len(raw) > self.max_reply_bytes:
            raise MalformedReply(f"LLM reply over {self.max_reply_bytes} bytes (not read further)")
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise MalformedReply("LLM reply is not valid UTF-8 text") from None
        except (ValueError, RecursionError):
            raise MalformedReply("LLM reply is not JSON") from None
        return _content(data)

    def propose(self, task: Task, history: list[Record]) -> Proposal | None:
        prompt = build_prompt(task, history)
        try:
            answer = self.chat([{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": prompt}])  # fmt: skip
        except MalformedReply as e:
            return Proposal("", None, f"llm {self.model}: malformed reply", rejected=str(e))
        code = extract_code(answer)
        if code is None:
            return Proposal(
                "", None, "llm answer had no code block: " + answer[:120].replace("\n", " ")
            )
        return Proposal(code, None, f"llm {self.model}")


def _content(data) -> str:
    """The text of choices[0].message.content: a string, or a list of content parts whose
    text parts are joined. MalformedReply when there is none, or it is not valid UTF-8."""
    try:
        msg = data["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise MalformedReply("LLM reply has no choices[0].message") from None
    content = msg.get("content") if isinstance(msg, dict) else None
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = [p.get("text") if isinstance(p, dict) else p for p in content]
        content = "".join(p for p in parts if isinstance(p, str))
    if content is not None and not isinstance(content, str):
        raise MalformedReply(f"proposer returned no text (content is a {type(content).__name__})")
    if not content or not content.strip():
        raise MalformedReply("proposer returned no text")
    try:
        content.encode("utf-8")
    except UnicodeEncodeError as e:
        raise MalformedReply(
            f"LLM reply is not valid UTF-8 text (a lone surrogate at character {e.start})"
        ) from None
    return content

"""`llm`: candidates written by a model behind any OpenAI-compatible chat endpoint
(vLLM, Ollama, llama.cpp server, a hosted API): POST {url}/chat/completions.

Each proposal is one call (the budget counts calls). The prompt holds the task (description,
signature, visible shapes, tolerance, the reference's and the baseline's source), the best
candidates so far with their speedups, and the last evaluator feedback (status, trimmed
error, timings). Held-out shapes and held-out results never enter a prompt. The answer's
first ```python block (or the whole answer if it has none but defines kernel) becomes the
candidate; an answer without code is recorded like any failed candidate, and its feedback
goes into the next prompt.
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


def extract_code(answer: str) -> str | None:
    """The candidate file in a model's answer, or None."""
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

    def chat(self, messages: list[dict]) -> str:
        body = json.dumps({"model": self.model, "messages": messages,
                           "temperature": self.temperature}).encode()  # fmt: skip
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        req = urllib.request.Request(self.url + "/chat/completions", body, headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                data = json.loads(resp.read().decode())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:200].replace("\n", " ")
            raise LabError(f"LLM endpoint {self.url} answered HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise LabError(f"LLM endpoint {self.url} unreachable: {reason}") from None
        except json.JSONDecodeError:
            raise LabError(f"LLM endpoint {self.url} did not answer JSON") from None
        try:
            return data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise LabError(f"LLM endpoint {self.url}: no choices[0].message.content in the answer") from None  # fmt: skip

    def propose(self, task: Task, history: list[Record]) -> Proposal | None:
        prompt = build_prompt(task, history)
        answer = self.chat([{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": prompt}])  # fmt: skip
        code = extract_code(answer)
        if code is None:
            return Proposal(
                "", None, "llm answer had no code block: " + answer[:120].replace("\n", " ")
            )
        return Proposal(code, None, f"llm {self.model}")

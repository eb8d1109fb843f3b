"""The llm proposer against a local stand-in for an OpenAI-compatible endpoint that
replays scripted answers and records the requests it got."""

from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from wanka.lab import runner as runner_mod
from wanka.lab.evaluator import EvalConfig, Feedback
from wanka.lab.proposers.base import Proposal, Proposer
from wanka.lab.proposers.llm import LLMProposer, extract_code
from wanka.lab.runner import RunConfig, run_task
from wanka.lab.store import Store
from wanka.lab.task import LabError, Shape
from wanka.lab.tasks import get_task

GOOD = """Here is a faster version.
```python
import torch

def kernel(x, weight, eps):
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * rstd * weight
```
"""
ANSWERS = ["I would fuse the two passes, but I cannot write code today.",
           "```python\ndef kernel(x, weight, eps:\n    return x\n```", GOOD]  # fmt: skip


class StandIn:
    def __init__(self, answers: list[str], status: int = 200):
        self.answers, self.status, self.requests = list(answers), status, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "body": body,
                                       "auth": self.headers.get("Authorization")})  # fmt: skip
                if outer.status != 200:
                    self.send_response(outer.status)
                    self.end_headers()
                    self.wfile.write(b'{"error": {"message": "model overloaded"}}')
                    return
                content = outer.answers.pop(0)
                reply = {"id": "x", "object": "chat.completion", "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": content}}]}  # fmt: skip
                # bytes: the whole HTTP body, as is (a malformed reply)
                data = content if isinstance(content, bytes) else json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def small_task():
    t = get_task("rmsnorm-cpu")
    return dataclasses.replace(
        t, shapes=(Shape("a", {"N": 16, "D": 64}),), timing_shape=Shape("t", {"N": 512, "D": 256}),
        held_out=(Shape("h", {"N": 5, "D": 24}),), held_out_timing=Shape("ht", {"N": 300, "D": 200}),
    )  # fmt: skip


def test_extract_code():
    assert extract_code(GOOD).startswith("import torch")
    assert extract_code("no code here") is None
    assert "def kernel" in extract_code("def kernel(x):\n    return x\n")


def test_llm_run_with_scripted_answers(tmp_path, small_task):
    srv = StandIn(ANSWERS)
    try:
        prop = LLMProposer(srv.url, "stand-in-model", api_key="sekrit")
        store = Store(tmp_path / "h.sqlite")
        cfg = RunConfig(budget=3, eval=EvalConfig(repeats=3))
        out = run_task(small_task, prop, store, cfg, log=lambda s: None)
    finally:
        srv.close()
    hist = store.candidates(out["run_id"])
    assert [r.status for r in hist] == ["policy", "policy", "correct"]  # budget = 3 calls
    assert len(srv.requests) == 3
    r0, r1, r2 = srv.requests
    assert r0["path"] == "/v1/chat/completions" and r0["auth"] == "Bearer sekrit"
    assert r0["body"]["model"] == "stand-in-model"
    user0 = r0["body"]["messages"][-1]["content"]
    assert "RMSNorm" in user0 and "def reference" in user0  # task + reference source
    assert "held" not in user0.lower()  # held-out shapes never reach the prompt
    assert "defines nothing" in r1["body"]["messages"][-1]["content"]  # last feedback
    assert "syntax error" in r2["body"]["messages"][-1]["content"]
    assert out["best"]["n"] == 3 and out["verified"] is not None


def test_prompt_quotes_the_best_candidates_so_far(tmp_path, small_task):
    srv = StandIn([GOOD, GOOD.replace("rstd * weight", "weight * rstd")])
    try:
        store = Store(tmp_path / "h.sqlite")
        run_task(small_task, LLMProposer(srv.url, "m"), store,
                 RunConfig(budget=2, eval=EvalConfig(repeats=3)),
                 log=lambda s: None)  # fmt: skip
    finally:
        srv.close()
    second = srv.requests[1]["body"]["messages"][-1]["content"]
    assert "## Candidate #1: correct" in second and "x * rstd * weight" in second


def test_unreachable_or_failing_endpoint_is_one_clear_error(small_task, monkeypatch):
    for var in ("WANKA_LLM_URL", "OPENAI_BASE_URL", "WANKA_LLM_MODEL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(LabError, match="unreachable") as e:
        LLMProposer("http://127.0.0.1:9/v1", "m", timeout_s=5).propose(small_task, [])
    assert "\n" not in str(e.value)
    srv = StandIn([], status=503)
    try:
        with pytest.raises(LabError, match="HTTP 503"):
            LLMProposer(srv.url, "m").propose(small_task, [])
    finally:
        srv.close()
    with pytest.raises(LabError, match="--llm-url"):
        LLMProposer(None, None)


# --- malformed replies: one rejected proposal each, never the end of the run ---------------


def body(content) -> bytes:
    return json.dumps(
        {"choices": [{"message": {"role": "assistant", "content": content}}]}
    ).encode()


SURROGATE = "```python\ndef kernel(x, weight, eps):\n    return x  # \ud800\n```"
MALFORMED = {
    "content 42": (body(42), "proposer returned no text (content is a int)"),
    "content null": (body(None), "proposer returned no text"),
    "content blank": (body("  \n"), "proposer returned no text"),
    "content parts without text": (body([{"type": "image_url", "image_url": {}}]),
                                   "proposer returned no text"),
    "content a dict": (body({"text": GOOD}), "proposer returned no text (content is a dict)"),
    "no choices": (b'{"id": "x", "object": "chat.completion"}', "no choices[0].message"),
    "empty choices": (b'{"choices": []}', "no choices[0].message"),
    "choices a string": (b'{"choices": "abc"}', "no choices[0].message"),
    "message a list": (b'{"choices": [{"message": [1]}]}', "proposer returned no text"),
    "body a list": (b"[1, 2]", "no choices[0].message"),
    "not JSON": (b"<html>502 bad gateway</html>", "LLM reply is not JSON"),
    "empty body": (b"", "LLM reply is not JSON"),
    "body not UTF-8": (b'{"choices": "\xff"}', "LLM reply is not valid UTF-8 text"),
    "deeply nested": (b"[" * 40_000 + b"]" * 40_000, "LLM reply is not JSON"),
    "lone surrogate": (body(SURROGATE), "not valid UTF-8 text (a lone surrogate"),
    "huge": (body("x" * 300_000), "LLM reply over 100000 bytes"),
}  # fmt: skip


@pytest.fixture
def stub_eval(monkeypatch):
    """The evaluator replaced by a stand-in that records what it was given."""
    seen: list[str] = []

    def fake(task, source, cfg, *a, **k):
        seen.append(source)
        return Feedback("incorrect", "stand-in verdict")

    monkeypatch.setattr(runner_mod, "evaluate", fake)
    return seen


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_reply_is_a_rejected_candidate_and_the_run_goes_on(
    tmp_path, small_task, stub_eval, case
):
    reply, reason = MALFORMED[case]
    srv = StandIn([reply, GOOD])
    try:
        prop = LLMProposer(srv.url, "m")
        prop.max_reply_bytes = 100_000
        store = Store(tmp_path / "h.sqlite")
        logs: list[str] = []
        out = run_task(small_task, prop, store, RunConfig(budget=2), log=logs.append)
    finally:
        srv.close()
    first, second = store.candidates(out["run_id"])
    assert first.status == "rejected" and reason in first.feedback.message
    assert "\n" not in first.feedback.message and first.feedback.flags == ["proposal"]
    assert store.verify(first) is None and isinstance(first.source, str)
    assert second.status == "incorrect" and stub_eval == [extract_code(GOOD)]  # went on
    assert store.run(out["run_id"]).finished is not None and out["evaluations"] == 2
    # the reason reaches the model with the next prompt, like any evaluator feedback
    assert reason in srv.requests[1]["body"]["messages"][-1]["content"]
    assert any(reason in line for line in logs)


def test_content_parts_are_joined(tmp_path, small_task, stub_eval):
    parts = [{"type": "text", "text": GOOD[:40]}, {"type": "text", "text": GOOD[40:]}]
    srv = StandIn([body(parts)])
    try:
        run_task(small_task, LLMProposer(srv.url, "m"), Store(tmp_path / "h.sqlite"),
                 RunConfig(budget=1), log=lambda s: None)  # fmt: skip
    finally:
        srv.close()
    assert stub_eval == [extract_code(GOOD)]


def test_extract_code_of_no_text_is_none():
    for answer in (None, 42, [GOOD], {"content": GOOD}, b"def kernel(x):\n    return x\n"):
        assert extract_code(answer) is None


class Scripted(Proposer):
    """Any proposer (not only llm) that hands the runner something that is no source."""

    name = "scripted"

    def __init__(self, proposals):
        self.proposals = list(proposals)

    def propose(self, task, history):
        return self.proposals.pop(0) if self.proposals else None


@pytest.mark.parametrize("prop, reason", [
    (Proposal(None), "proposer returned no text (a NoneType)"),
    (Proposal(b"def kernel(x, weight, eps):\n    return x\n"), "proposer returned no text (a bytes)"),
    (Proposal("def kernel(x, weight, eps):\n    return x  # \udcff\n"),
     "not valid UTF-8 text (a lone surrogate at character 44)"),
    (Proposal("def kernel(x, weight, eps):\n    return x\0\n"), "source contains a NUL character"),
    (Proposal("#" * ((1 << 20) + 1)), "over the 1048576 byte limit"),
    (Proposal("x = 1\n", note="bad \udc80 note\nsecond line", rejected="told so \udc80"),
     "told so \\udc80"),
])  # fmt: skip
def test_the_runner_records_a_proposal_that_is_no_source(tmp_path, small_task, stub_eval,
                                                        prop, reason):  # fmt: skip
    ok = Proposal("def kernel(x, weight, eps):\n    return x\n", note="fine")
    store = Store(tmp_path / "h.sqlite")
    out = run_task(small_task, Scripted([prop, ok]), store, RunConfig(budget=2),
                   log=lambda s: None)  # fmt: skip
    first, second = store.candidates(out["run_id"])
    assert first.status == "rejected" and reason in first.feedback.message
    assert store.verify(first) is None and len(first.source) <= runner_mod.KEPT_BYTES
    assert "\n" not in first.note and first.note.encode("utf-8") is not None
    assert stub_eval == [ok.source] and second.status == "incorrect"
    assert store.run(out["run_id"]).finished is not None

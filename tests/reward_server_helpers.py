"""A real HTTP reward service for the tests of tests/test_remote_reward.py: it binds 127.0.0.1 on a free port,
scores each response by how many ``a`` it holds (or by ``score_of``), in any of the three schemas, and can be
slow, flaky (its first requests answer 503), demand a key, or answer the wrong schema."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def responses_of(schema: str, body) -> list[str]:
    """The responses a request in ``schema`` carries."""
    if schema == "openrlhf":
        return [query[len(prompt) :] for query, prompt in zip(body["query"], body["prompts"])]
    if schema == "verl":
        return [sample["solution_str"] for sample in body]
    return [sample["response"] for sample in body["samples"]]


def answer_for(schema: str, scores: list[float]):
    if schema == "openrlhf":
        return {"rewards": scores}
    if schema == "verl":
        return [{"score": score, "length": float(len(str(score)))} for score in scores]
    return {"scores": scores}


class RewardServer:
    """The service; ``requests`` records each request's headers and decoded body, ``most_in_flight`` the most
    requests it was answering at once. Settings may change while it runs."""

    def __init__(self, schema="ppoflow", *, delay_s=0.0, fail_first=0, api_key=None, score_of=None):
        self.schema, self.delay_s, self.fail_first, self.api_key = schema, delay_s, fail_first, api_key
        self.score_of = score_of or (lambda text: text.count("a"))
        self.wrong_answer = None
        self.requests: list[tuple[dict, object]] = []
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    server.requests.append((dict(self.headers), body))
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                    failing = len(server.requests) <= server.fail_first
                try:
                    time.sleep(server.delay_s)
                    if server.api_key and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                        return self._send(401, {"error": "no key"})
                    if failing:
                        return self._send(503, {"error": "busy"})
                    if server.wrong_answer is not None:
                        return self._send(200, server.wrong_answer)
                    scores = [float(server.score_of(text)) for text in responses_of(server.schema, body)]
                    self._send(200, answer_for(server.schema, scores))
                finally:
                    with server._lock:
                        server.in_flight -= 1

            def _send(self, status: int, payload) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:  # the client gave up (timed out) first
                    pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/score"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> RewardServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

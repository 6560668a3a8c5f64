"""One vLLM engine shared by many callers: every caller's requests join one continuously batched engine.

vLLM batches whatever is queued in it. A rollout worker that handed vLLM one group
(n = 8 sequences) and waited for it decoded 8 wide where ~160 is possible, one group
after another. Here every call (each rollout group, evaluation or scoring batch the
worker is given, on its own thread) enqueues its requests at once; one loop thread
steps the engine while anything is unfinished, and each caller returns as soon as
its own requests have finished, so a group is handed on while the others still decode.

Log-prob entries are returned as ids and values, never decoded to text (`undecoded_logprobs`).

Everything that touches the engine (enqueue, step, collective_rpc, cache resets)
runs under one lock: vLLM's in-process engine is not thread-safe. Per step the loop
records how many sequences the engine ran (`StepRecord`), which
`benchmarks/bench_rollout_occupancy.py` reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

MAX_RECORDS = 65536  # step records kept for readers (oldest dropped first)


@dataclass(frozen=True)
class StepRecord:
    """One engine step: sequences it ran (those still running after it + those it finished) and those it finished."""

    at: float  # perf_counter when the step ended
    ran: int
    finished: int


@dataclass
class _Call:
    """One caller's requests: its outputs by request id, and the future it waits on."""

    pending: int
    outputs: dict
    done: Future = field(default_factory=Future)

    def finish(self, output) -> None:
        self.outputs[output.request_id] = output
        self.pending -= 1
        if self.pending == 0:
            self.done.set_result(None)


class EngineBusyError(RuntimeError):
    """Something that needs an idle engine (a weight write) was asked while requests were in it."""


def undecoded_logprobs(state) -> None:
    """Keep vLLM from spelling out a request's log-prob entries: with `detokenize` on (which its stop strings need),
    vLLM's output processor decodes every returned log-prob id to text, one `tokenizer.decode([id])` per entry, on
    the engine's thread between steps (1 + k per generated token; at k = 100 ~1.6 ms a token on the CPU build, a 5x
    slower rollout). Nothing here reads those strings: the ids and values are read, and the response text is still
    decoded for the stop strings. `state` is the request's entry in the output processor."""
    processor = state.logprobs_processor
    if processor is None:
        return
    if not hasattr(processor, "tokenizer"):  # a vLLM whose processor is laid out otherwise: say so, do not guess
        raise RuntimeError(f"vLLM's LogprobsProcessor has no `tokenizer` (fields: {sorted(vars(processor))}): update"
                           " undecoded_logprobs for this vLLM release")
    processor.tokenizer = None  # its update then records ids and log-probs with no decoded text


class EngineLoop:
    """Runs `vllm.LLM` requests of concurrent callers in one engine (see the module's docstring)."""

    def __init__(self, llm):
        self.llm = llm
        self.lock = threading.Lock()  # held for every engine call
        self.work = threading.Condition(self.lock)  # the loop waits on it for requests
        self.waiters: dict[str, _Call] = {}  # request id -> its caller
        self.records: list[StepRecord] = []
        self.failure: BaseException | None = None  # once stepping failed, every call fails with it
        self.thread: threading.Thread | None = None  # started with the first request
        core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        self.scheduler = getattr(core, "scheduler", None)

    def run(self, requests: Sequence[dict], params: Sequence) -> list:
        """Outputs of `requests` in their order, once all of them have finished (other callers' keep running)."""
        if not requests:
            return []
        with self.work:
            if self.failure is not None:
                raise RuntimeError("the vLLM engine failed earlier") from self.failure
            states = [self.llm.llm_engine.output_processor.request_states[internal]
                      for internal in self.llm.enqueue(list(requests), list(params), use_tqdm=False)]
            for state in states:
                undecoded_logprobs(state)
            ids = [state.external_req_id for state in states]  # outputs carry the caller-side id, not vLLM's internal one
            call = _Call(len(ids), {})
            self.waiters.update(dict.fromkeys(ids, call))
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="vllm-engine-loop", daemon=True)
                self.thread.start()
            self.work.notify()
        call.done.result()
        return [call.outputs[request_id] for request_id in ids]

    def call(self, fn: Callable, *args, idle: bool = False, **kwargs):
        """`fn(llm, ...)` under the engine's lock; with `idle`, refused while any request is in the engine."""
        with self.lock:
            if idle and self.waiters:
                raise EngineBusyError(f"the engine is sampling {len(self.waiters)} request(s): it must be idle for this")
            return fn(self.llm, *args, **kwargs)

    def _loop(self) -> None:
        try:
            while True:
                self._step()
                time.sleep(0)  # yield the GIL between steps, so a caller waiting for the lock gets to enqueue
        except BaseException as exc:  # noqa: BLE001 - every caller learns why, none waits forever
            with self.lock:
                self._fail(exc)

    def _step(self) -> None:
        with self.work:
            while not self.waiters:
                self.work.wait()
            in_engine = len(self.waiters)
            finished = [o for o in self.llm.llm_engine.step() if o.finished]
            ran = len(finished) + (len(self.scheduler.running) if self.scheduler is not None else in_engine - len(finished))
            self.records.append(StepRecord(time.perf_counter(), ran, len(finished)))
            del self.records[:-MAX_RECORDS]
            for output in finished:
                self.waiters.pop(output.request_id).finish(output)

    def _fail(self, exc: BaseException) -> None:
        self.failure = exc
        for call in {id(c): c for c in self.waiters.values()}.values():  # each caller once
            call.done.set_exception(exc)
        self.waiters.clear()

    def steps_since(self, begin: float) -> list[StepRecord]:
        with self.lock:
            return [r for r in self.records if r.at >= begin]

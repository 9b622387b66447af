"""`EvalConfig`: what one `structkv eval` run asks for, checked when made; `IDENTITY`, the settings
that define what a result folder's numbers mean."""
from __future__ import annotations

from dataclasses import dataclass, field

from ... import methods as methods_registry
from ...models.quantized import check_weights
from ...modules.budget import Budget
from ...ops.kv_quant import check_kv_dtype
from .benchmarks import BENCHMARKS
from .benchmarks import get as get_benchmark

# Settings that define what a result means: a folder cannot mix runs that differ in these.
IDENTITY = ("benchmark", "model", "seed", "first", "struct_budget", "max_new_tokens", "window", "longbench_full",
            "chat", "chat_every_task", "question_after", "continuation", "weights", "kv_dtype", "archive")


@dataclass
class EvalConfig:
    benchmark: str
    model: str = "gemma-3-270m"
    methods: list[str] = field(default_factory=lambda: ["full", "snapkv", "structkv"])
    kv_budgets: list[float] = field(default_factory=lambda: [0.1])
    struct_budget: float = 0.2
    lengths: list[int] = field(default_factory=lambda: [4096])
    tasks: list[str] | None = None  # None: every task of the benchmark
    samples: int | None = None  # per task; None: 10 generated (RULER, niah), every record (LongBench)
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])  # niah only
    seed: int = 42
    # The first sample index of every task: LongBench records and RULER samples from here on, so a
    # development split (first > 0) never shares a prompt with the default run (first 0).
    first: int = 0
    max_new_tokens: int | None = None  # cap on each task's own generation length
    window: int | None = None  # observation window of the scoring methods (None: each method's default)
    longbench_full: bool = False  # LongBench: the full task files instead of subset/
    data_dir: str | None = None
    compile: bool = True
    # Instruct models: each task prompt becomes one user turn of the model's chat template (RULER's
    # answer prefix, where a task has one, follows the opened assistant turn; a needle prompt goes
    # whole, its answer prefix inside the turn).
    chat: bool = False
    # With `chat`: LongBench's few-shot and code tasks in the template too (LongBench's pred.py, and
    # the default here, leave them plain: `longbench.PLAIN_UNDER_CHAT`).
    chat_every_task: bool = False
    # One prefill per group of methods that compute the same hidden states, and one stacked decode
    # of every method's state per sample (same predictions, ~4x less work). False: every method
    # runs alone, so each record's prefill and decode times are its own call's.
    shared: bool = True
    # Query-agnostic (kvpress' setting): the context is compressed without the question, which is
    # appended uncompressed afterwards. False: the whole prompt is compressed (query-aware).
    question_after: bool = False
    # fidelity: tokens of the full cache's greedy continuation teacher-forced through each method
    continuation: int = 64
    # How the projections are stored and multiplied (structkv.models.quantized): "fp32", "bf16",
    # "int8", "int4"
    weights: str = "fp32"
    # How the KV caches store their entries: None (the model's floats), "int8", "int4"
    kv_dtype: str | None = None
    # Ask-time recall (question after compression): every compressing method also runs once per
    # recall budget here (label "name@R_KV+recall<r>"), its evicted entries archived as `archive`
    recall: list = field(default_factory=list)
    archive: str = "int4"

    def __post_init__(self):  # budgets parsed once, where the config is made ("0.1" a ratio, "512" a count)
        self.kv_budgets = [Budget.parse(b, "kv_budget").value for b in self.kv_budgets]
        self.recall = [Budget.parse(r, "recall").value for r in self.recall]
        from ...models.archive import check_kind
        check_kind(self.archive)
        self.struct_budget = Budget.parse(self.struct_budget, "struct_budget").value
        check_weights(self.weights)
        check_kv_dtype(self.kv_dtype)

    def validate(self, model_config=None) -> None:
        bench = get_benchmark(self.benchmark)
        valid = methods_registry.names()
        for name in self.methods:
            if name not in valid:
                raise ValueError(f"unknown method {name!r}; valid: {', '.join(valid)}")
        if not self.methods:
            raise ValueError("give at least one method")
        if isinstance(self.first, bool) or not isinstance(self.first, int) or self.first < 0:
            raise ValueError(f"first must be a sample index >= 0, got {self.first!r}")
        if self.first and self.samples is None:
            raise ValueError("first needs samples: the split's records are first .. first + samples - 1")
        if self.samples is not None and self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if isinstance(self.continuation, bool) or not isinstance(self.continuation, int) or self.continuation < 1:
            raise ValueError(f"continuation must be a positive number of tokens, got {self.continuation!r}")
        if self.chat_every_task and not self.chat:
            raise ValueError("--chat-every-task changes what --chat wraps; add --chat")
        if self.recall and not self.question_after:
            raise ValueError("--recall asks each question against the compressed context: add "
                             "--question-after-compression")
        if self.recall and not self.shared:
            raise ValueError("--recall runs in the shared pass; drop --separate")
        if self.question_after and not bench.question_after:
            able = " and ".join(n for n, b in BENCHMARKS.items() if b.question_after)
            raise ValueError(f"--question-after-compression supports {able}; {self.benchmark}'s prompts have no "
                             "separate question")
        for d in self.depths:
            if not 0 <= d <= 1:
                raise ValueError(f"needle depths are fractions in [0, 1], got {d}")
        tasks = self.all_tasks() + (self.extra_tasks())
        for t in self.tasks or []:
            if t not in tasks:
                raise ValueError(f"unknown {self.benchmark} task {t!r}; valid: {', '.join(tasks)}")
        bench.check_data(self)
        if model_config is not None:
            limit = model_config.max_position_embeddings
            for n in self.lengths:
                if n > limit:
                    raise ValueError(f"length {n} exceeds the model's {limit} positions; use lengths <= {limit}")

    @property
    def bench(self):
        """The benchmark this run measures (`structkv.harness.eval.benchmarks`)."""
        return get_benchmark(self.benchmark)

    def task_samples(self, task: str) -> int:
        """Samples the run asks of `task` (per length; niah: per depth): LongBench has only its
        file's records."""
        return self.bench.task_samples(self, task)

    def extra_tasks(self) -> list[str]:
        """Tasks run only when named (`niah_many`: RULER-style, ours)."""
        return self.bench.extra_tasks()

    def all_tasks(self) -> list[str]:
        return self.bench.tasks()

"""Tests for `benchmarks/workload.py`: traces are a function of the seed, and chat-shaped."""

from __future__ import annotations

import statistics

from benchmarks.workload import Arrivals, WorkloadConfig, answer_token_ids, generate

CONFIG = WorkloadConfig(seed=3, num_conversations=200)


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    assert generate(CONFIG) == generate(CONFIG)
    assert generate(CONFIG).requests != generate(WorkloadConfig(seed=4)).requests
    request = generate(CONFIG).requests[5]
    assert answer_token_ids(CONFIG, request, 1) == answer_token_ids(CONFIG, request, 1)
    assert answer_token_ids(CONFIG, request, 1) != answer_token_ids(CONFIG, request, 2)


def test_lengths_are_long_tailed_and_fit_the_context() -> None:
    trace = generate(CONFIG)
    messages = sorted(
        len(r.new_token_ids) - (CONFIG.system_prompt_len if r.parent is None else 0)
        for r in trace.requests
    )
    answers = sorted(r.output_len for r in trace.requests)
    for lengths in (messages, answers):
        median = statistics.median(lengths)
        assert statistics.fmean(lengths) > median  # skewed right
        assert lengths[int(0.99 * len(lengths))] > 4 * median  # a long tail
    assert all(r.prompt_len + r.output_len <= CONFIG.max_model_len for r in trace.requests)


def test_shared_system_prompts_returning_users_and_parallel_samples() -> None:
    trace = generate(CONFIG)
    firsts = [r for r in trace.requests if r.parent is None]
    assert len(firsts) == CONFIG.num_conversations
    prefixes = {r.new_token_ids[: CONFIG.system_prompt_len] for r in firsts}
    assert len(prefixes) == CONFIG.num_system_prompts
    follow_ups = [r for r in trace.requests if r.parent is not None]
    assert 0.25 < len(follow_ups) / len(firsts) < 1.5
    assert all(r.think_s > 0 for r in follow_ups)
    parallel = [r for r in trace.requests if r.n > 1]
    assert parallel and all(r.n == CONFIG.parallel_n for r in parallel)
    arrivals = [r.arrival_s for r in firsts]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_a_follow_up_is_due_after_its_parent_and_extends_its_history() -> None:
    trace = generate(WorkloadConfig(seed=1, num_conversations=20, return_prob=1.0))
    arrivals = Arrivals(trace, burst=False)
    first = arrivals.due(float("inf"))
    assert all(r.parent is None for r in first)
    parent = first[0]
    prompt = arrivals.prompt(parent)
    answer = answer_token_ids(trace.config, parent, 0)
    arrivals.finish(parent, 100.0, [*prompt, *answer])
    child = trace.by_id()[f"c{parent.conversation}t1"]
    assert arrivals.due(100.0 + child.think_s - 1e-9) == []
    assert arrivals.due(100.0 + child.think_s) == [child]
    child_prompt = arrivals.prompt(child)
    assert child_prompt == [*prompt, *answer, *child.new_token_ids]
    assert child.prompt_len == len(child_prompt)

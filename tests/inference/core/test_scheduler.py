"""The scheduler with hand-built runner outputs (vLLM's tests/v1/core/test_scheduler.py): chunked
prefill, the token budget and sequence limit, preemption by recompute, prefix-cache hits and
speculative rows, step by step, without a model."""

from __future__ import annotations

from core_helpers import Core, ranges, seq

from tessera.inference.core.sequence import Status


def test_a_long_prompt_is_prefilled_in_chunks_of_the_budget_then_decodes_one_token_a_step():
    core = Core(num_blocks=16, budget=4)
    a = seq("a", list(range(1, 11)), max_tokens=3)
    core.add(a)
    chunks = [ranges(core.step()[0])["a"] for _ in range(3)]
    assert chunks == [(0, 4), (4, 4), (8, 2)]  # the last chunk completes the prompt and samples
    assert a.output_ids == [7] and a.num_computed == 10
    assert ranges(core.step()[0]) == {"a": (10, 1)}
    assert len(core.blocks.table(a)) == 3  # 11 tokens in blocks of 4


def test_running_sequences_go_first_and_waiting_ones_are_admitted_in_order_within_budget_and_seq_limit():
    core = Core(num_blocks=32, budget=10, max_seqs=2)
    a, b, c = seq("a", [1] * 6), seq("b", [2] * 6), seq("c", [3] * 3)
    core.add(a, b, c)
    assert ranges(core.step()[0]) == {"a": (0, 6), "b": (0, 4)}  # the budget cuts b's prompt
    assert ranges(core.step()[0]) == {"a": (6, 1), "b": (4, 2)}  # c waits: two sequences at most
    assert [s.request_id for s in core.scheduler.waiting] == ["c"]


def test_a_short_pool_preempts_the_newest_sequence_which_later_recomputes_its_prompt_and_output():
    core = Core(num_blocks=4, budget=16, prefix_caching=False)  # 16 slots
    a, b = seq("a", [1] * 7, max_tokens=3), seq("b", [2] * 7, max_tokens=3)
    core.add(a, b)
    core.step()  # both prompts: 2 blocks each, the pool is full
    assert ranges(core.step()[0]) == {"a": (7, 1), "b": (7, 1)}  # 8 tokens each still fit
    plan, _ = core.step()  # a's 9th token needs a third block: b gives its blocks up
    assert ranges(plan) == {"a": (8, 1)}
    assert b.status is Status.WAITING and b.num_computed == 0 and core.scheduler.num_preemptions == 1
    assert list(core.scheduler.waiting) == [b] and core.blocks.table(b) == []
    assert a.is_finished and a.output_ids == [7, 7, 7]
    plan, _ = core.step()  # b recomputes prompt + the 2 tokens it had generated, then samples
    assert ranges(plan) == {"b": (0, 9)} and b.output_ids == [7, 7, 7] and b.is_finished
    assert core.blocks.num_used == 0


def test_nothing_is_admitted_in_a_step_that_preempted():
    core = Core(num_blocks=4, budget=16, prefix_caching=False)
    a, b, c = seq("a", [1] * 7), seq("b", [2] * 7), seq("c", [3])
    core.add(a, b)
    core.step()
    core.step()
    core.add(c)  # one token: a block would be free once b is preempted
    assert ranges(core.step()[0]) == {"a": (8, 1)}
    assert [s.request_id for s in core.scheduler.waiting] == ["b", "c"]


def test_a_prompt_that_shares_full_blocks_with_an_earlier_one_starts_past_them():
    core = Core(num_blocks=16)
    a = seq("a", list(range(1, 10)), max_tokens=1)  # 9 tokens: blocks [1-4] [5-8] full
    core.add(a)
    core.step()
    assert a.is_finished
    b = seq("b", list(range(1, 9)) + [40, 41, 42])
    core.add(b)
    plan, _ = core.step()
    assert ranges(plan) == {"b": (8, 3)} and b.num_cached_tokens == 8
    assert plan.scheduled[0].block_table[:2] == [0, 1]  # a's blocks, shared
    assert (core.blocks.prefix_hits, core.blocks.prefix_queries) == (8, 9 + 11)


def test_a_prefix_hit_leaves_the_last_token_to_compute_and_prompt_logprobs_skip_the_cache():
    core = Core(num_blocks=16)
    core.add(seq("a", list(range(1, 10)), max_tokens=1))
    core.step()
    same = seq("same", list(range(1, 9)))  # exactly two full cached blocks: the second is recomputed
    scoring = seq("scoring", list(range(1, 10)), prompt_logprobs=True)
    core.add(same, scoring)
    assert ranges(core.step()[0]) == {"same": (4, 4), "scoring": (0, 9)}


def test_draft_tokens_are_verified_in_one_row_and_rejected_ones_give_their_blocks_back():
    core = Core(num_blocks=16)
    a = seq("a", [1, 2, 3, 4, 5], max_tokens=10)
    core.add(a)
    core.step()  # prefill: a samples 7
    a.spec_token_ids = [20, 21, 22]  # as a proposer leaves them after the step
    plan = core.scheduler.schedule()
    s = plan.scheduled[0]
    assert (s.start, s.num_new, s.spec_token_ids, s.tokens()) == (5, 4, [20, 21, 22], [7, 20, 21, 22])
    assert len(s.block_table) == 3  # room for the newest token and every draft
    core.apply(plan, {"a": [20, 30]})  # the runner accepts the first draft and samples 30
    assert a.output_ids == [7, 20, 30] and a.num_computed == 7 and a.spec_token_ids == []
    assert len(core.blocks.table(a)) == 2  # the block that held only rejected drafts is free again
    stats = core.processor.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.accepted_per_pos) == \
        (1, 3, 1, [1, 0, 0])
    assert ranges(core.step()[0]) == {"a": (7, 1)}  # decoding goes on from the last accepted token


def test_drafts_are_cut_to_the_budget_left_after_one_token_for_each_later_sequence():
    core = Core(num_blocks=32, budget=4)
    a, b = seq("a", [1, 2]), seq("b", [3, 4])
    core.add(a, b)
    core.step()
    a.spec_token_ids, b.spec_token_ids = [9, 9, 9], [8, 8, 8]
    plan, _ = core.step({"a": [9, 9, 7], "b": [5]})
    assert [len(s.spec_token_ids) for s in plan.scheduled] == [2, 0] and ranges(plan) == {"a": (2, 3), "b": (2, 1)}
    assert a.output_ids == [7, 9, 9, 7] and b.output_ids == [7, 5]


def test_an_aborted_request_leaves_the_queue_and_its_blocks_are_free_at_once():
    core = Core(num_blocks=8)
    a, b = seq("a", [1] * 6), seq("b", [2] * 5)
    core.add(a, b)
    core.step()
    core.scheduler.abort(a)
    assert a.finish_reason == "abort" and core.scheduler.running == [b]
    assert core.blocks.num_used == len(core.blocks.table(b)) == 2

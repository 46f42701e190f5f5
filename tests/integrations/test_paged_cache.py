"""PagedCache: layout, block tables, the free list, growth, limits and refusals."""

from __future__ import annotations

import copy
import gc
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from pytest_mock import MockerFixture

from attn_di.exceptions import InvalidBackendTypeError, InvalidInputError, UnsupportedFeatureError
from attn_di.integrations.transformers import PagedCache

from .conftest import left_padded, tiny_llama

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11]]


@pytest.fixture(name="llama")
def _llama() -> transformers.PreTrainedModel:
    """The tiny Llama of the conftest on ``"attn_di:CPU_ATTN"``."""
    return tiny_llama("attn_di:CPU_ATTN")


def test_keys_live_at_their_slots_in_the_backend_layout(
    llama: transformers.PreTrainedModel,
) -> None:
    """After a prefill each real token's key sits at block_table[p // bs] * bs + p % bs."""
    ids, mask = left_padded(PROMPTS)
    cache = PagedCache(llama.config, block_size=4, fill_value=float("nan"))
    reference = transformers.DynamicCache()
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, cache=cache)
        llama.set_attn_implementation("eager")
        llama(input_ids=ids, attention_mask=mask, cache=reference)
    assert cache.seq_lens == [3, 6]
    assert cache.get_seq_length() == 6
    kv_cache = cache._kv_caches[1]
    assert tuple(kv_cache.shape) == (2, cache.num_blocks, 4, 2, 8)
    for row, prompt in enumerate(PROMPTS):
        pad = ids.shape[1] - len(prompt)
        table = cache.block_tables[row]
        assert len(table) == -(-len(prompt) // 4)
        for position in range(len(prompt)):
            stored = kv_cache[0, table[position // 4], position % 4]
            expected = reference.layers[1].keys[row, :, pad + position]
            torch.testing.assert_close(stored, expected)
    used = {block for table in cache.block_tables for block in table}
    assert cache.num_free_blocks == cache.num_blocks - len(used)


def test_reset_frees_every_block(llama: transformers.PreTrainedModel) -> None:
    """reset() returns every block to the free list and forgets the sequences."""
    ids, mask = left_padded(PROMPTS)
    cache = PagedCache(llama.config, block_size=2)
    with torch.no_grad():
        llama.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
            pad_token_id=0, cache=cache,
        )  # fmt: skip
    assert cache.num_free_blocks < cache.num_blocks
    cache.reset()
    assert cache.num_free_blocks == cache.num_blocks
    assert cache.seq_lens == []
    assert cache.get_seq_length() == 0


def test_pool_grows_and_keeps_what_it_holds(llama: transformers.PreTrainedModel) -> None:
    """With num_blocks=None the pool doubles when needed and generation still matches."""
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        expected = llama.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0
        )
        cache = PagedCache(llama.config, block_size=1, fill_value=float("nan"))
        tokens = llama.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
            pad_token_id=0, cache=cache,
        )  # fmt: skip
    assert cache.num_blocks > 16
    assert tokens.tolist() == expected.tolist()


def test_fixed_pool_that_runs_out_raises_and_changes_nothing(
    llama: transformers.PreTrainedModel,
) -> None:
    """A fixed num_blocks that is too small fails with a typed error naming num_blocks."""
    ids, mask = left_padded(PROMPTS)
    cache = PagedCache(llama.config, block_size=2, num_blocks=3)
    with pytest.raises(InvalidInputError, match="num_blocks") as caught, torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, cache=cache)
    assert "num_blocks=None" in str(caught.value.hint)
    assert cache.seq_lens == []
    assert cache.block_tables == []


def test_sampling_matches_eager_with_the_same_seed(llama: transformers.PreTrainedModel) -> None:
    """Sampled generation through the paged cache equals eager's under the same seed."""
    ids, mask = left_padded(PROMPTS)
    options = {"max_new_tokens": 12, "do_sample": True, "top_k": 0, "pad_token_id": 0}
    with torch.no_grad():
        llama.set_attn_implementation("eager")
        torch.manual_seed(1)
        expected = llama.generate(input_ids=ids, attention_mask=mask, **options)
        llama.set_attn_implementation("attn_di")
        torch.manual_seed(1)
        cache = PagedCache(llama.config, fill_value=float("nan"))
        tokens = llama.generate(input_ids=ids, attention_mask=mask, cache=cache, **options)
    assert tokens.tolist() == expected.tolist()


def test_beam_search_is_refused(llama: transformers.PreTrainedModel) -> None:
    """Beam search (which reorders rows) fails naming the unsupported operation."""
    ids, mask = left_padded(PROMPTS)
    with pytest.raises(UnsupportedFeatureError, match="PagedCache"), torch.no_grad():
        llama.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=3, num_beams=2, do_sample=False,
            pad_token_id=0, cache=PagedCache(llama.config),
        )  # fmt: skip


def test_another_batch_without_reset_is_refused(llama: transformers.PreTrainedModel) -> None:
    """A cache holding B sequences refuses a batch of another size until reset()."""
    ids, mask = left_padded(PROMPTS)
    cache = PagedCache(llama.config)
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, cache=cache)
        with pytest.raises(InvalidInputError, match="reset"):
            llama(input_ids=ids[:1, -1:], cache=cache)
        cache.reset()
        llama(input_ids=ids[:1], attention_mask=mask[:1], cache=cache)
    assert cache.seq_lens == [3]


@pytest.mark.parametrize(("option", "value"), [("block_size", 0), ("num_blocks", -1)])
def test_bad_sizes_are_refused(
    llama: transformers.PreTrainedModel, option: str, value: int
) -> None:
    """Non-positive sizes are refused by name, with an example in the hint."""
    with pytest.raises(InvalidInputError, match=option):
        PagedCache(llama.config, **{option: value})


def test_repr_shows_the_pool(llama: transformers.PreTrainedModel) -> None:
    """The repr tells layers, block size, blocks used and sequence lengths."""
    assert repr(PagedCache(llama.config, block_size=8)) == (
        "PagedCache(layers=2, block_size=8, blocks=0/0 used, seq_lens=[])"
    )


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_a_new_prompt_no_longer_than_the_cache_is_refused(
    llama: transformers.PreTrainedModel, rows: int
) -> None:
    """generate() on a used cache with a prompt within its columns fails typed, cache unchanged."""
    ids, mask = left_padded(PROMPTS)
    options = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    cache = PagedCache(llama.config)
    with torch.no_grad():
        llama.generate(input_ids=ids, attention_mask=mask, cache=cache, **options)
        seq_lens, columns = cache.seq_lens, cache.get_seq_length()
        prompt = torch.tensor([[5, 6, 7, 8]] * rows)
        with pytest.raises(InvalidInputError, match="cache") as caught:
            llama.generate(
                input_ids=prompt, attention_mask=torch.ones_like(prompt), cache=cache, **options
            )
    assert "cache.reset()" in str(caught.value.hint)
    assert (cache.seq_lens, cache.get_seq_length()) == (seq_lens, columns)


def test_running_out_after_a_step_leaves_the_cache_as_it_was(
    llama: transformers.PreTrainedModel,
) -> None:
    """A step that runs out of a fixed pool leaves lengths, columns and blocks untouched."""
    ids, mask = left_padded(PROMPTS)
    cache = PagedCache(llama.config, block_size=2, num_blocks=5)
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, cache=cache)
        before = (cache.seq_lens, cache.get_seq_length(), cache.block_tables)
        free = cache.num_free_blocks
        with pytest.raises(InvalidInputError, match="num_blocks"):
            llama(input_ids=torch.tensor([[1, 2], [3, 4]]), cache=cache)
    assert (cache.seq_lens, cache.get_seq_length(), cache.block_tables) == before
    assert cache.num_free_blocks == free
    assert before[:2] == ([3, 6], 6)


def test_a_failed_first_step_records_nothing(llama: transformers.PreTrainedModel) -> None:
    """A first step that fails in the backend (cache dtype mismatch) leaves the cache empty."""
    ids, mask = left_padded(PROMPTS)
    cache = PagedCache(llama.config, dtype=torch.float64)
    with pytest.raises(InvalidInputError, match="dtype"), torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, cache=cache)
    assert (cache.seq_lens, cache.get_seq_length(), cache.block_tables) == ([], 0, [])
    assert cache.num_free_blocks == cache.num_blocks


@pytest.mark.parametrize(
    ("options", "error", "argument", "hint"),
    [
        ({"dtype": "float31"}, InvalidInputError, "dtype", "float32"),
        ({"dtype": torch.int8}, InvalidInputError, "dtype", "'"),
        ({"dtype": 4}, InvalidBackendTypeError, "dtype", "dtype=None"),
        ({"device": "banana"}, InvalidInputError, "device", "'cpu'"),
        ({"device": "cuda"}, InvalidInputError, "device", "'cpu'"),
        ({"device": 3.5}, InvalidBackendTypeError, "device", "device=None"),
        ({"fill_value": "nan"}, InvalidBackendTypeError, "fill_value", 'float("nan")'),
        ({"fill_value": True}, InvalidBackendTypeError, "fill_value", 'float("nan")'),
        ({"block_size": 10**9}, InvalidInputError, "block_size", "16"),
    ],
)
def test_bad_arguments_are_refused_at_construction(
    llama: transformers.PreTrainedModel,
    options: dict[str, object],
    error: type[Exception],
    argument: str,
    hint: str,
) -> None:
    """Each bad argument fails in PagedCache() with a typed error naming it and a hint."""
    if options.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(error, match=argument) as caught:
        PagedCache(llama.config, **options)  # type: ignore[arg-type]
    assert hint in str(caught.value.hint)  # type: ignore[attr-defined]


@pytest.mark.parametrize("config", [None, {"num_hidden_layers": 2}, "model"])
def test_a_config_that_is_not_a_config_is_refused(
    llama: transformers.PreTrainedModel, config: object
) -> None:
    """None, a dict or the model itself in place of model.config fails typed, hinting at it."""
    given = llama if config == "model" else config
    with pytest.raises(InvalidBackendTypeError, match="config") as caught:
        PagedCache(given)  # type: ignore[arg-type]
    assert "model.config" in str(caught.value.hint)
    if config == "model":
        assert "not the model" in str(caught.value.hint)


@pytest.mark.parametrize("dtype", ["float32", "fp32", "torch.float32", torch.float32])
def test_dtype_names_are_accepted(llama: transformers.PreTrainedModel, dtype: object) -> None:
    """dtype takes torch dtypes and attn_di's dtype names, and the cache uses it."""
    cache = PagedCache(llama.config, dtype=dtype, device="cpu")  # type: ignore[arg-type]
    assert (cache.dtype, cache.device) == (torch.float32, torch.device("cpu"))
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, cache=cache)
    assert cache._kv_caches[0].dtype == torch.float32


def test_a_cache_in_another_dtype_points_at_the_constructor(
    llama: transformers.PreTrainedModel,
) -> None:
    """A cache dtype other than the model's fails with a hint at PagedCache(dtype=...)."""
    ids, mask = left_padded(PROMPTS)
    cache = PagedCache(llama.config, dtype="bf16")
    with pytest.raises(InvalidInputError, match="dtype") as caught, torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, cache=cache)
    assert 'PagedCache(model.config, dtype="float32")' in str(caught.value.hint)


def test_several_return_sequences_match_eager(llama: transformers.PreTrainedModel) -> None:
    """Sampling 4 sequences per prompt on a PagedCache equals eager's under the same seed."""
    ids, mask = left_padded(PROMPTS)
    options = {
        "max_new_tokens": 6, "do_sample": True, "top_k": 0, "pad_token_id": 0,
        "num_return_sequences": 4,
    }  # fmt: skip
    with torch.no_grad():
        llama.set_attn_implementation("eager")
        torch.manual_seed(2)
        expected = llama.generate(input_ids=ids, attention_mask=mask, **options)
        llama.set_attn_implementation("attn_di")
        torch.manual_seed(2)
        cache = PagedCache(llama.config, fill_value=float("nan"))
        tokens = llama.generate(input_ids=ids, attention_mask=mask, cache=cache, **options)
    assert tokens.shape[0] == 8
    assert tokens.tolist() == expected.tolist()
    assert len(cache.seq_lens) == 8


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=lambda m: m.__name__)
def test_the_layers_of_a_step_check_its_metadata_once(
    llama: transformers.PreTrainedModel, mocker: MockerFixture, mode: Any
) -> None:
    """One metadata check per step, not per layer, also under inference_mode (the step's
    tensors keep version counters there)."""
    from attn_di.backends import _common

    ids, mask = left_padded(PROMPTS)
    cache = PagedCache(llama.config)
    spy = mocker.spy(_common, "_check_metadata")
    with mode():
        llama(input_ids=ids, attention_mask=mask, cache=cache)
        assert spy.call_count == 1
        step = torch.tensor([[12], [13]])
        llama(
            input_ids=step, attention_mask=torch.cat([mask, torch.ones_like(step)], 1), cache=cache
        )
    assert spy.call_count == 2


# -- a step is all or nothing ----------------------------------------------------------------
class _FailOnce:
    """A forward hook (or pre-hook) that raises a copy of ``error`` the first time it runs
    (a copy: the parametrized instance never gets a traceback, which would keep the failed
    test's model and cache alive)."""

    def __init__(self, error: BaseException) -> None:
        self.error: BaseException | None = error

    def __call__(self, *args: Any) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise copy.copy(error)


def _where(model: transformers.PreTrainedModel, where: str, error: BaseException) -> Any:
    """Arm a one-shot failure at ``where`` in ``model``; returns the hook handle."""
    layers = model.model.layers
    if where == "mlp of the last layer":
        return layers[-1].mlp.register_forward_hook(_FailOnce(error))
    if where == "between layers":
        return layers[1].register_forward_pre_hook(_FailOnce(error))
    if where == "after the last layer":
        return model.lm_head.register_forward_hook(_FailOnce(error))
    raise AssertionError(where)


TOKENS = [[[9], [10]], [[11], [12]], [[13], [14]]]
"""The tokens of the decode steps after the prompt, one per row."""

FAILURES = pytest.mark.parametrize(
    ("where", "error"),
    [
        ("mlp of the last layer", RuntimeError("an MLP fails")),
        ("between layers", KeyboardInterrupt()),
        ("after the last layer", RuntimeError("a hook on lm_head fails")),
    ],
    ids=["mlp", "interrupt-between-layers", "after-last-layer"],
)
"""Where a step fails (see :func:`_where`), and with what."""


def _step_inputs(index: int) -> dict[str, torch.Tensor]:
    """Step ``index``'s model inputs: the prompt (0), then one token per row at a time."""
    ids, mask = left_padded(PROMPTS)
    if index == 0:
        return {"input_ids": ids, "attention_mask": mask}
    mask = torch.cat([mask, torch.ones(len(PROMPTS), index, dtype=mask.dtype)], dim=1)
    return {"input_ids": torch.tensor(TOKENS[index - 1]), "attention_mask": mask}


def _logits(model: transformers.PreTrainedModel, cache: Any, index: int) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(**_step_inputs(index), cache=cache).logits[:, -1]
    return logits


def _two_model_objects() -> tuple[Any, Any, list[torch.Tensor]]:
    """``(model, second, expected)``: a tiny model on attn_di's CPU_ATTN, a second model object
    with its config and weights (never called), and eager's logits of every step."""
    model = tiny_llama("attn_di:CPU_ATTN")
    second = transformers.LlamaForCausalLM(model.config).eval()
    second.load_state_dict(model.state_dict())
    second.set_attn_implementation("attn_di:CPU_ATTN")
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    reference = transformers.DynamicCache()
    return model, second, [_logits(eager, reference, index) for index in range(len(TOKENS) + 1)]


@pytest.mark.parametrize("step", [0, 2], ids=["prompt", "third-step"])
@FAILURES
def test_a_failed_step_is_rolled_back_and_its_retry_matches_eager(
    step: int, where: str, error: BaseException
) -> None:
    """A step that fails anywhere in the model's forward (an MLP, KeyboardInterrupt between
    layers, a hook after the last layer), on a fresh model and cache too, leaves the cache as
    it was; retrying the step gives eager's logits, and so do the steps after it."""
    model = tiny_llama("attn_di:CPU_ATTN")
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    reference = transformers.DynamicCache()
    expected = [_logits(eager, reference, index) for index in range(len(TOKENS) + 1)]
    cache = PagedCache(model.config, block_size=2, fill_value=float("nan"))
    for index, logits in enumerate(expected):
        if index == step:
            before = (cache.seq_lens, cache.get_seq_length(), cache.block_tables)
            used = cache.num_blocks - cache.num_free_blocks
            handle = _where(model, where, error)
            with pytest.raises(type(error)):
                _logits(model, cache, index)
            handle.remove()
            assert (cache.seq_lens, cache.get_seq_length(), cache.block_tables) == before
            assert cache.num_blocks - cache.num_free_blocks == used  # a grown pool stays
        torch.testing.assert_close(_logits(model, cache, index), logits, atol=1e-4, rtol=1e-4)


def test_a_cache_built_for_another_model_is_refused() -> None:
    """A PagedCache checks the model calling it, not the config it was built from: another
    model's layout (more KV heads), or a model on another attention implementation, is
    refused with attn_di's error, and the cache is left as it was."""
    model = tiny_llama("attn_di:CPU_ATTN")
    cache = PagedCache(model.config, block_size=2)
    _logits(model, cache, 0)
    before = (cache.seq_lens, cache.get_seq_length(), cache.block_tables)
    wider = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4,
    )  # fmt: skip
    other = transformers.LlamaForCausalLM(wider).eval()
    other.set_attn_implementation("attn_di:CPU_ATTN")
    with pytest.raises(InvalidInputError, match="another model") as caught:
        _logits(other, cache, 1)
    assert "PagedCache(model.config)" in str(caught.value.hint)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with pytest.raises(InvalidInputError, match="'eager'"):
        _logits(eager, cache, 1)
    assert (cache.seq_lens, cache.get_seq_length(), cache.block_tables) == before
    _logits(model, cache, 1)  # its own model still runs on it
    assert cache.seq_lens == [before[0][0] + 1, before[0][1] + 1]


def test_the_hook_path_is_held_while_a_cache_lives() -> None:
    """A cache keeps a no-op global forward pre-hook (torch then runs module hooks, so the
    first forward of any model that steps it is seen returning) for as long as it lives,
    stepped or not; once every cache is garbage, no global hook is left."""
    from torch.nn.modules import module as torch_module

    from attn_di.integrations.transformers import _scope

    def global_hooks() -> int:
        return sum(
            hook is _scope._no_op for hook in torch_module._global_forward_pre_hooks.values()
        )

    model = tiny_llama("attn_di:CPU_ATTN")
    gc.collect()
    held = _scope._hook_path[0]  # caches other tests left alive (0 when run alone)
    cache = PagedCache(model.config)
    unused = PagedCache(model.config)
    assert (_scope._hook_path[0], global_hooks()) == (held + 2, 1)
    _logits(model, cache, 0)
    del unused
    gc.collect()
    assert (_scope._hook_path[0], global_hooks()) == (held + 1, 1)  # the stepped cache holds it
    _logits(model, cache, 1)
    del cache
    gc.collect()
    assert (_scope._hook_path[0], global_hooks()) == (held, 1 if held else 0)
    assert list(model._forward_hooks.values()) == [_scope._committed]


@FAILURES
def test_a_failed_first_step_of_a_second_model_object_is_rolled_back(
    where: str, error: BaseException
) -> None:
    """A cache stepped twice by its model, then by a second model object of the same config
    and weights (never called before, no hooks of its own) whose first step fails anywhere:
    that step is rolled back as the first model's would be, and the retry and the step after
    it give eager's logits."""
    model, second, expected = _two_model_objects()
    cache = PagedCache(model.config, block_size=2, fill_value=float("nan"))
    for index in (0, 1):
        torch.testing.assert_close(
            _logits(model, cache, index), expected[index], atol=1e-4, rtol=1e-4
        )
    before = (cache.seq_lens, cache.get_seq_length(), cache.block_tables)
    used = cache.num_blocks - cache.num_free_blocks
    handle = _where(second, where, error)
    with pytest.raises(type(error)):
        _logits(second, cache, 2)
    handle.remove()
    assert (cache.seq_lens, cache.get_seq_length(), cache.block_tables) == before
    assert cache.num_blocks - cache.num_free_blocks == used
    for index in (2, 3):
        torch.testing.assert_close(
            _logits(second, cache, index), expected[index], atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize("make_copy", [copy.deepcopy, copy.copy], ids=["deepcopy", "copy"])
def test_a_copied_cache_holds_the_hook_path_and_rolls_back(
    make_copy: Callable[[PagedCache], PagedCache],
) -> None:
    """A copy of a stepped cache (transformers' prompt-reuse pattern: deepcopy a prefilled
    cache) holds torch's hook path once the original is garbage, so a failed first step of a
    second model object on the copy is rolled back and its retry gives eager's logits."""
    from attn_di.integrations.transformers import _scope

    model, second, expected = _two_model_objects()
    gc.collect()
    held = _scope._hook_path[0]
    original = PagedCache(model.config, block_size=2, fill_value=float("nan"))
    for index in (0, 1):
        _logits(model, original, index)
    cache = make_copy(original)
    del original
    gc.collect()
    assert _scope._hook_path[0] == held + 1
    before = (cache.seq_lens, cache.get_seq_length(), cache.block_tables)
    handle = _where(second, "mlp of the last layer", RuntimeError("an MLP fails"))
    with pytest.raises(RuntimeError, match="an MLP fails"):
        _logits(second, cache, 2)
    handle.remove()
    assert (cache.seq_lens, cache.get_seq_length(), cache.block_tables) == before
    torch.testing.assert_close(_logits(second, cache, 2), expected[2], atol=1e-4, rtol=1e-4)
    del cache
    gc.collect()
    assert _scope._hook_path[0] == held


def test_a_cache_in_a_step_in_another_thread_is_refused() -> None:
    """One cache stepped by two threads at once: the second is refused while the first is
    mid-step, and the first step completes unharmed."""
    model = tiny_llama("attn_di:CPU_ATTN")
    cache = PagedCache(model.config)
    inside, resume = threading.Event(), threading.Event()

    def pause(*args: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            inside.set()
            resume.wait(timeout=60)

    handle = model.model.layers[1].register_forward_pre_hook(pause)
    results: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: results.append(_logits(model, cache, 0)))
    worker.start()
    assert inside.wait(timeout=60)
    try:
        with pytest.raises(InvalidInputError, match="in the middle of a step in another thread"):
            _logits(model, cache, 0)
    finally:
        resume.set()
        worker.join(timeout=60)
        handle.remove()
    assert len(results) == 1
    assert cache.seq_lens == [3, 6]


def test_threads_stepping_their_own_caches_on_one_model_match_eager() -> None:
    """Four threads run one model, each on its own PagedCache, at the same time: each
    thread's steps are committed by the model's own forward, and every logit is eager's."""
    model = tiny_llama("attn_di:CPU_ATTN")
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    reference = transformers.DynamicCache()
    expected = [_logits(eager, reference, index) for index in range(len(TOKENS) + 1)]
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            cache = PagedCache(model.config, block_size=2)
            barrier.wait()
            for _ in range(3):
                for index, logits in enumerate(expected):
                    torch.testing.assert_close(
                        _logits(model, cache, index), logits, atol=1e-4, rtol=1e-4
                    )
                cache.reset()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert errors == []


def test_a_reader_in_another_thread_sees_the_committed_state_while_a_step_runs() -> None:
    """A monitor reading the cache (repr, seq_lens, num_free_blocks, block_tables,
    num_blocks) while another thread is in the middle of a step sees the state committed
    before that step (it raised "in the middle of a step in another thread"), and the step
    completes unharmed; afterwards the step's own state is what is read."""
    model = tiny_llama("attn_di:CPU_ATTN")
    cache = PagedCache(model.config, block_size=2)
    _logits(model, cache, 0)  # the prompt, committed: rows of 3 and 6 tokens
    committed = (cache.seq_lens, cache.block_tables, cache.num_free_blocks, cache.num_blocks)
    assert committed[0] == [3, 6]
    inside, resume = threading.Event(), threading.Event()

    def pause(*args: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            inside.set()
            resume.wait(timeout=60)

    handle = model.model.layers[1].register_forward_pre_hook(pause)
    results: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: results.append(_logits(model, cache, 1)))
    worker.start()
    assert inside.wait(timeout=60)
    try:  # layer 0 has run: the step took a block for the second row (7 tokens in blocks of 2)
        seen = (cache.seq_lens, cache.block_tables, cache.num_free_blocks, cache.num_blocks)
        text = repr(cache)
    finally:
        resume.set()
        worker.join(timeout=60)
        handle.remove()
    assert seen == committed
    used = committed[3] - committed[2]
    assert text == (
        f"PagedCache(layers=2, block_size=2, blocks={used}/{committed[3]} used, seq_lens=[3, 6])"
    )
    assert len(results) == 1
    assert cache.seq_lens == [4, 7]
    assert [len(table) for table in cache.block_tables] == [2, 4]
    assert cache.num_free_blocks == cache.num_blocks - 6


def test_repr_never_raises(llama: transformers.PreTrainedModel, mocker: MockerFixture) -> None:
    """A repr that cannot read the state says why instead of raising (a logger or a
    debugger calls it at any moment)."""
    cache = PagedCache(llama.config)
    mocker.patch.object(PagedCache, "_committed", side_effect=RuntimeError("broken"))

    assert repr(cache) == (
        "PagedCache(layers=2, block_size=16, state unreadable: RuntimeError: broken)"
    )

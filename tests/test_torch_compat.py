"""concur._torch_compat: version parsing, an untested release warns once, version counters, small accessors."""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch

from concur import _torch_compat as compat
from tests.amp_loop import MovedStateScaler


@pytest.mark.parametrize("version, expected", [("2.14.1", (2, 14)), ("2.11.0+cu130", (2, 11)),
                                               ("2.15.0.dev20261101", (2, 15)), ("3.0.0a0", (3, 0))])
def test_the_version_is_major_and_minor(version, expected, monkeypatch):
    monkeypatch.setattr(torch, "__version__", version)
    assert compat.torch_version() == expected


@pytest.mark.parametrize("version", [(2, 11), (2, 13), (2, 14), (2, 15)])
def test_the_releases_the_readme_lists_as_tested_are_tested(version, monkeypatch):
    monkeypatch.setattr(compat, "torch_version", lambda: version)
    assert compat.untested_torch() is None


@pytest.mark.parametrize("version", [(2, 10), (2, 12), (2, 16), (3, 0)])
def test_a_release_between_or_beside_the_tested_ones_is_untested(version, monkeypatch):
    """2.12 lies between two tested releases and was never tested itself."""
    monkeypatch.setattr(compat, "torch_version", lambda: version)
    monkeypatch.setattr(torch, "__version__", f"{version[0]}.{version[1]}.0")
    assert compat.untested_torch() == (
        f"torch {version[0]}.{version[1]}.0 is not one of the releases concur's torch.compile backend was tested on "
        "(2.11, 2.13, 2.14 and 2.15): inductor's generated code may have changed, so every graph whose wrapper "
        "concur does not fully read runs as plain inductor output (with a warning)")


def test_an_untested_release_warns_once(monkeypatch):
    monkeypatch.setattr(compat, "_warned_untested", [])
    monkeypatch.setattr(compat, "torch_version", lambda: (2, 12))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.warn_if_untested_torch()
        compat.warn_if_untested_torch()
    assert len(caught) == 1 and str(caught[0].message).startswith("concur backend: torch ")


def test_the_version_counter_counts_in_place_writes_through_views():
    t = torch.zeros(4)
    before = compat.version_counter(t)
    t[:2].add_(1)
    assert compat.version_counter(t) == before + 1
    with torch.inference_mode():
        assert compat.version_counter(torch.zeros(2)) == -1  # inference tensors have none


def test_symbolic_shapes_are_recognised():
    assert compat.has_symbolic_shapes([torch.zeros(2), 3]) is False
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    sym = ShapeEnv().create_unbacked_symint()
    assert compat.has_symbolic_shapes([sym]) is True


def test_buffer_reuse_is_set_inside_the_block_and_restored_after():
    from torch._inductor import config

    before = config.allow_buffer_reuse
    with compat.inductor_buffer_reuse(not before):
        assert config.allow_buffer_reuse is (not before)
    assert config.allow_buffer_reuse is before


def test_compile_phases_are_seconds_by_name():
    phases = compat.compile_phase_seconds()
    assert all(isinstance(k, str) and v >= 0 for k, v in phases.items())


def test_a_missing_internal_names_itself_and_the_tested_releases():
    err = compat._compile_internal("torch._inductor.x", ImportError("gone"))
    assert f"needs torch._inductor.x, which torch {torch.__version__} does not provide (ImportError: gone)" in str(err)
    assert "tested on torch 2.11, 2.13, 2.14 and 2.15;" in str(err)


def test_op_schemas_are_read_for_op_overloads_only():
    schema = compat.op_schema(torch.ops.aten.add_.Tensor)
    assert [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] == ["self"]
    assert compat.is_op_overload(torch.ops.aten.add_.Tensor)
    for target in (torch.ops.aten.add_, torch.relu, "add_", None):  # a packet, a function, not ops at all
        assert compat.op_schema(target) is None and not compat.is_op_overload(target)


def test_an_op_overload_without_a_schema_fails_closed(monkeypatch):
    """A torch that moved the schema raises: never "this op writes nothing"."""
    op = torch.ops.aten.add_.Tensor
    monkeypatch.delattr(op, "_schema")
    with pytest.raises(RuntimeError, match="OpOverload._schema"):
        compat.op_schema(op)


def test_switching_an_optimizer_to_fused_for_gradscaler_warns_once_and_a_fused_one_not_at_all():
    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.Adam(params, lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compat.enable_device_side_amp_skip(opt)
        assert compat.enable_device_side_amp_skip(opt)  # a second train_step on the same optimizer
        assert compat.enable_device_side_amp_skip(torch.optim.SGD(params, lr=0.1, fused=True))
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "Adam under GradScaler was switched to fused=True" in str(caught[0].message)
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)


def test_step_hooks_are_seen_own_and_global_and_an_unknown_torch_counts_as_hooked(monkeypatch):
    from torch.optim import optimizer as optim_module

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert not compat.optimizer_has_step_hooks(opt)
    handle = opt.register_step_pre_hook(lambda *a: None)
    assert compat.optimizer_has_step_hooks(opt)
    handle.remove()
    handle = optim_module.register_optimizer_step_post_hook(lambda *a: None)
    assert compat.optimizer_has_step_hooks(opt)
    handle.remove()
    monkeypatch.delattr(optim_module, "_global_optimizer_pre_hooks")
    assert compat.optimizer_has_step_hooks(opt)


def test_a_step_replaced_on_the_instance_counts_unless_an_lr_scheduler_wrapped_it():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert not compat.step_replaced_on_instance(opt)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    assert not compat.step_replaced_on_instance(opt)
    opt.step = lambda closure=None: None
    assert compat.step_replaced_on_instance(opt)


def test_a_view_shares_the_models_own_dicts_and_answers_its_state_dict():
    class View(compat.StateDictOfOriginal, torch.nn.Module):
        pass

    model = torch.nn.BatchNorm1d(3)
    view = View()
    compat.share_module_state(view, model)
    object.__setattr__(view, "original", model)
    assert view._parameters is model._parameters and view._buffers is model._buffers
    assert view.state_dict().keys() == model.state_dict().keys()
    assert view._version == model._version


def test_a_torch_that_keeps_module_state_elsewhere_shares_nothing():
    model = torch.nn.Linear(2, 2)
    del model.__dict__["_state_dict_pre_hooks"]
    view = torch.nn.Module()
    before = view._parameters
    with pytest.raises(RuntimeError, match="keeps it elsewhere"):
        compat.share_module_state(view, model)
    assert view._parameters is before


def test_external_objects_are_in_the_table_during_the_block_and_a_dict_table_keeps_them():
    table = compat.external_object_table()
    objects = compat.ExternalObjects()
    a, b, c = torch.Event(), torch.Event(), torch.Event()
    index = 3000  # above dynamo's own indices, below concur's (stamp.TABLE_BASE)
    objects.add(index, a)
    objects.add(index + 2, b)
    try:
        with objects.installed({index + 1: c}):
            table = compat.external_object_table()
            assert [table[i]() for i in (index, index + 1, index + 2)] == [a, c, b]
        table = compat.external_object_table()
        if isinstance(table, dict):  # torch < 2.15: they stay, and are put back only when missing
            assert table[index]() is a
            table[index] = weakref.ref(c)  # the sentinel (the newest, index + 2) is still there: no rewrite
            with objects.installed():
                assert table[index]() is c
        else:  # torch >= 2.15: out again after the block
            assert len(table) < index
    finally:
        if isinstance(table, dict):
            for i in (index, index + 1, index + 2):
                table.pop(i, None)


def _torchs_twin(t: torch.Tensor) -> bool:
    """torch's own Python twin of c10's ``suggest_memory_format`` (it agrees with c10 on the tested releases)."""
    if compat.untested_torch() is not None:
        pytest.skip("torch's Python twin of c10's rule is checked against c10 on the tested releases only")
    from torch._prims_common import suggest_memory_format

    return suggest_memory_format(t) == torch.channels_last


def _both_rules_agree_with_torch(t: torch.Tensor) -> None:
    """What compat answers, and c10's rule as concur writes it out for other releases, against torch's twin."""
    expected = _torchs_twin(t)
    assert compat.suggests_channels_last(t) is expected, (tuple(t.shape), t.stride(), t.device)
    assert compat._c10_strides_like_channels_last(t.shape, t.stride()) is expected, (tuple(t.shape), t.stride())


def _weights_and_views() -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Sizes and strides: convolution weights in both formats (1x1, depthwise, one channel) and odd views."""
    cases = []
    for size in ((16, 8, 3, 3), (16, 8, 1, 1), (16, 1, 3, 3), (1, 8, 1, 1), (8, 1, 1, 1), (1, 1, 1, 1),
                 (2, 3, 1, 4), (0, 8, 3, 3), (16, 0, 1, 1)):
        for fmt in (torch.contiguous_format, torch.channels_last):
            t = torch.empty(size, device="meta").to(memory_format=fmt)
            cases += [(tuple(t.shape), t.stride()), (tuple(t[:, :1].shape), t[:, :1].stride())]
    base = torch.empty(4, 8, 6, 5, device="meta")
    for view in (base.permute(0, 2, 3, 1), base.permute(0, 3, 1, 2), base[:, :, ::2], base[:1].expand(3, -1, -1, -1),
                 base[:, :1].expand(-1, 8, -1, -1), base.transpose(2, 3), base.transpose(0, 1)):
        cases.append((tuple(view.shape), view.stride()))
    # where torch's Python twin and c10 disagreed before pytorch#172830: unit strides of sizes above 1
    cases += [((1, 2, 1, 1), (2, 1, 2, 1)), ((1, 1, 2, 1), (2, 1, 1, 1)), ((1, 1, 1, 3), (2, 1, 2, 1))]
    return cases


def test_channels_last_is_suggested_as_c10_suggests_it_for_real_meta_and_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cases = _weights_and_views()
    with FakeTensorMode():
        fakes = [torch.empty_strided(size, stride) for size, stride in cases]
    for (size, stride), fake in zip(cases, fakes):
        for t in (torch.empty_strided(size, stride), torch.empty_strided(size, stride, device="meta"), fake):
            _both_rules_agree_with_torch(t)
    assert compat.suggests_channels_last(torch.empty(16, 8, 1, 1).to(memory_format=torch.channels_last))
    assert not compat.suggests_channels_last(torch.empty(16, 8, 1, 1))
    assert not compat.suggests_channels_last(torch.empty(8, 1, 1, 1))  # N111: contiguous by c10's convention
    assert compat.suggests_channels_last(torch.empty_strided((1, 1, 2, 1), (2, 1, 1, 1)))


@pytest.mark.parametrize("sizes", [(1, 2, 3), (0, 1, 2)])
def test_channels_last_is_suggested_as_c10_suggests_it_for_every_small_stride(sizes):
    import itertools

    for size in itertools.product(sizes, repeat=4):
        for stride in itertools.product((0, 1, 2, 3, 6), repeat=4):
            _both_rules_agree_with_torch(torch.empty_strided(size, stride, device="meta"))


def _pooling_suggests_channels_last(size: tuple[int, ...], stride: tuple[int, ...]) -> bool | None:
    """c10's ``suggest_memory_format`` as torch's public ops show it, or None where they cannot tell.

    aten's CPU ``max_pool2d`` lays its output out in the input's
    ``suggest_memory_format()``; with a 1x1 window the output has the
    input's sizes, so its strides are either the contiguous or the
    channels-last ones. None where those two coincide (e.g. N111) or a size
    is 0 (pooling refuses it).
    """
    if 0 in size:
        return None
    contiguous = torch.empty(size).stride()
    channels_last = torch.empty(size, memory_format=torch.channels_last).stride()
    if contiguous == channels_last:
        return None
    out = torch.nn.functional.max_pool2d(torch.empty_strided(size, stride), 1).stride()
    assert out in (contiguous, channels_last), (size, stride, out)
    return out == channels_last


def test_outside_the_tested_releases_torchs_python_copy_is_not_asked(monkeypatch):
    import torch._prims_common as prims_common

    wrong = lambda t: torch.channels_last  # noqa: E731 - a torch whose answer must not be used
    monkeypatch.setattr(prims_common, "suggest_memory_format", wrong)
    contiguous = torch.empty(16, 8, 3, 3, device="meta")
    if compat.untested_torch() is None:
        assert compat.suggests_channels_last(contiguous)  # torch's is asked on a tested release
    monkeypatch.setattr(compat, "untested_torch", lambda: "outside")
    assert not compat.suggests_channels_last(contiguous)


def test_without_torchs_python_copy_the_answer_is_what_torchs_pooling_lays_out(monkeypatch):
    """c10's rule, as concur writes it out, against c10 itself (through max_pool2d), not against a copy."""
    import itertools

    import torch._prims_common as prims_common

    monkeypatch.delattr(prims_common, "suggest_memory_format")
    cases = _weights_and_views() + [(size, stride) for size in itertools.product((1, 2, 3), repeat=4)
                                    for stride in itertools.product((0, 1, 2, 3, 6), repeat=4)]
    told = {True: 0, False: 0}
    for size, stride in cases:
        expected = _pooling_suggests_channels_last(size, stride)
        if expected is None:
            continue
        told[expected] += 1
        assert compat.suggests_channels_last(torch.empty_strided(size, stride, device="meta")) is expected, \
            (size, stride)
    assert told[True] > 100 and told[False] > 10_000, told  # the oracle decided many cases both ways
    for size in ((0, 8, 3, 3), (16, 0, 1, 1), (2, 3, 0, 4)):  # c10 reads no format into an empty tensor
        for fmt in (torch.contiguous_format, torch.channels_last):
            assert not compat.suggests_channels_last(torch.empty(size, device="meta").to(memory_format=fmt))
    assert not compat.suggests_channels_last(torch.empty(8, 1, 1, 1))  # N111: contiguous by c10's convention


def test_only_a_strided_4d_tensor_suggests_channels_last():
    assert not compat.suggests_channels_last(torch.empty(2, 8, 3, 3, 3).to(memory_format=torch.channels_last_3d))
    assert not compat.suggests_channels_last(torch.empty(8, 3, 3))
    assert not compat.suggests_channels_last(torch.eye(4).reshape(2, 2, 2, 2).to_sparse())


def _fake_allocator(monkeypatch, fails: bool = False) -> list[str]:
    calls: list[str] = []

    def setter(conf: str) -> None:
        if fails:
            raise RuntimeError(f"Unrecognized key {conf}")
        calls.append(conf)

    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", setter)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", setter, raising=False)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    return calls


def test_captures_reuse_cross_stream_blocks_inside_the_block_only(monkeypatch):
    calls = _fake_allocator(monkeypatch)
    with compat.capture_reuses_cross_stream_blocks():
        assert calls == ["graph_capture_record_stream_reuse:True"]
    assert calls == ["graph_capture_record_stream_reuse:True", "graph_capture_record_stream_reuse:False"]
    calls.clear()
    with pytest.raises(KeyError):  # switched off again when the capture fails
        with compat.capture_reuses_cross_stream_blocks():
            raise KeyError
    assert calls[-1] == "graph_capture_record_stream_reuse:False"


def test_cross_stream_reuse_leaves_the_users_setting_and_unknown_allocators_alone(monkeypatch):
    calls = _fake_allocator(monkeypatch)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,graph_capture_record_stream_reuse:False")
    with compat.capture_reuses_cross_stream_blocks():
        pass
    assert calls == []
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    with compat.capture_reuses_cross_stream_blocks():
        pass
    assert calls == []
    _fake_allocator(monkeypatch, fails=True)  # a torch whose allocator does not know the option: nothing changes
    with compat.capture_reuses_cross_stream_blocks():
        pass


def test_whether_captures_reuse_cross_stream_blocks_follows_the_users_setting_the_backend_and_torch(monkeypatch):
    _fake_allocator(monkeypatch)
    assert compat.captures_reuse_cross_stream_blocks()  # concur switches it on for its captures
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,graph_capture_record_stream_reuse:False")
    assert not compat.captures_reuse_cross_stream_blocks()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "graph_capture_record_stream_reuse: True")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert compat.captures_reuse_cross_stream_blocks()
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert not compat.captures_reuse_cross_stream_blocks()
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(compat, "torch_version", lambda: (2, 8))
    assert not compat.captures_reuse_cross_stream_blocks()


def test_rewritten_calls_allocate_on_the_callers_stream_only_where_captures_reuse_cross_stream_blocks(monkeypatch):
    from concur.inductor.stream_backend import allocates_on_caller

    monkeypatch.setattr(compat, "captures_reuse_cross_stream_blocks", lambda: False)
    assert not allocates_on_caller(torch.device("cuda", 0)) and allocates_on_caller(torch.device("cpu"))
    monkeypatch.setattr(compat, "captures_reuse_cross_stream_blocks", lambda: True)
    assert allocates_on_caller(torch.device("cuda", 0))


# --- private seams that must fail closed: inductor's pass hash, its post-grad setting and stream names ---


def test_a_pass_uuid_is_the_files_sha256_with_or_without_torchs_helper(tmp_path, monkeypatch):
    import hashlib

    import torch._inductor.custom_graph_pass as custom_graph_pass

    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_bytes(b"x = 1\n")
    b.write_bytes(b"y = 2\n")
    expected = hashlib.sha256(b"opts" + b"x = 1\n" + b"y = 2\n").digest()
    assert compat.hash_for_files((str(a), str(b)), extra="opts") == expected
    monkeypatch.delattr(custom_graph_pass, "get_hash_for_files")
    assert compat.hash_for_files((str(a), str(b)), extra="opts") == expected
    b.write_bytes(b"y = 3\n")
    assert compat.hash_for_files((str(a), str(b)), extra="opts") != expected


def test_the_post_grad_pass_goes_after_the_users_and_a_torch_without_the_setting_names_it(monkeypatch):
    import types

    import torch._inductor
    from torch._inductor import config

    def users(graph):
        pass

    def ours(graph):
        pass

    with config.patch(post_grad_custom_post_pass=users):
        with compat.post_grad_custom_post_pass(ours):
            assert config.post_grad_custom_post_pass == [users, ours]
        assert config.post_grad_custom_post_pass is users
    monkeypatch.setattr(torch._inductor, "config", types.SimpleNamespace())  # a torch that renamed the setting
    with pytest.raises(RuntimeError, match="needs torch._inductor.config.post_grad_custom_post_pass"):
        with compat.post_grad_custom_post_pass(ours):
            pass


def test_stream_names_are_inductors_and_a_torch_without_them_names_the_module(monkeypatch):
    import sys

    assert compat.inductor_stream_names(3) == ["default_stream", "stream1", "stream2"]
    monkeypatch.setitem(sys.modules, "torch._inductor.stream_constants", None)  # import fails, as when moved
    with pytest.raises(RuntimeError, match="needs torch._inductor.stream_constants"):
        compat.inductor_stream_names(3)


# --- GradScaler's private state ---------------------------------------------------------------------


def test_a_fresh_scaler_has_no_tensors_yet_and_a_used_one_has_both():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert compat.grad_scaler_unreadable(scaler) is None
    assert compat.grad_scaler_tensors(scaler) == (None, None)  # before the first scale(): not an error
    compat.reset_grad_scaler(scaler, None, None)  # nothing to put back yet
    scaler.scale(torch.ones(()))
    scale, growth = compat.grad_scaler_tensors(scaler)
    assert scale.item() == 1024.0 and growth.item() == 0
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    assert compat.grad_scaler_unreadable(disabled) is None and compat.grad_scaler_tensors(disabled) == (None, None)


def test_a_scaler_whose_state_moved_raises_instead_of_restoring_nothing():
    scaler = MovedStateScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))
    assert "GradScaler has no _scale, _growth_tracker" in compat.grad_scaler_unreadable(scaler)
    with pytest.raises(RuntimeError, match="concur cannot save and put back the loss scale"):
        compat.grad_scaler_tensors(scaler)
    with pytest.raises(RuntimeError, match="concur cannot save and put back the loss scale"):
        compat.reset_grad_scaler(scaler, torch.tensor(8.0), torch.tensor(0, dtype=torch.int32))

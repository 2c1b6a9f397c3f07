"""The device interface (worker/device.py): every backend has every member of `DeviceBackend`
with a signature the runner's calls fit, the runner uses exactly those members, and the generic
runner holds no backend's rules (it imports no backend)."""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import ttserve.worker
from ttserve.worker.backends.torch.backend import TorchBackend
from ttserve.worker.backends.ttnn.backend import TtnnBackend
from ttserve.worker.device import DeviceBackend
from ttserve.worker.planning.mesh import resolve_mesh

WORKER = Path(ttserve.worker.__file__).parent
BACKENDS = [TorchBackend, TtnnBackend]
# The modules every backend shares: none may import a backend or tt-metal's rules.
GENERIC = ["runner.py", "device.py", "batch.py", "sampling.py", "step_check.py"]


def protocol_members() -> dict[str, object]:
    return {name: value for name, value in vars(DeviceBackend).items() if not name.startswith("_")}


def signature_problem(want: inspect.Signature, got: inspect.Signature) -> str | None:
    """Why a method with signature `got` cannot stand for one with `want` (both with self)."""
    wanted = list(want.parameters.values())[1:]
    given = list(got.parameters.values())[1:]
    by_name = {p.name: p for p in given}
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in given)  # the protocol's **inputs
    positional = [p for p in given if p.kind is p.POSITIONAL_OR_KEYWORD]
    for i, p in enumerate(q for q in wanted if q.kind is q.POSITIONAL_OR_KEYWORD):
        if i >= len(positional) or positional[i].name != p.name:
            return f"positional parameter {i + 1} should be {p.name!r}"
    for p in wanted:
        if p.kind is p.VAR_KEYWORD:
            if not var_keyword:
                return "takes no **kwargs"
            continue
        mine = by_name.get(p.name)
        if mine is None:
            # Named, not left to **kwargs: a backend forwards its **kwargs to the model, so a
            # parameter it leaves there (`previous`, say) would reach the model unread.
            return f"takes no {p.name!r}"
        if p.default is not p.empty and mine.default is p.empty:
            return f"{p.name!r} has no default"
    names = {p.name for p in wanted}
    for p in given:
        if p.name not in names and p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            return f"requires {p.name!r}, which the runner never passes"
    return None


def test_the_protocol_lists_a_documented_member_for_each_call():
    members = protocol_members()
    assert len(members) == 20
    for name, member in members.items():
        doc = member.__doc__ if isinstance(member, property) else inspect.getdoc(member)
        assert doc and len(doc) > 40, f"{name} states no contract"


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda cls: cls.__name__)
def test_every_backend_has_every_member_with_a_compatible_signature(backend):
    for name, member in protocol_members().items():
        assert hasattr(backend, name), f"{backend.__name__} lacks {name}"
        mine = getattr(backend, name)
        if isinstance(member, property):
            assert not callable(mine) or isinstance(mine, property), f"{backend.__name__}.{name} is a method"
            continue
        assert callable(mine), f"{backend.__name__}.{name} is not a method"
        problem = signature_problem(inspect.signature(member), inspect.signature(mine))
        assert problem is None, f"{backend.__name__}.{name}: {problem}"


def test_the_runner_uses_exactly_the_protocols_members():
    used = set(re.findall(r"self\.backend\.(\w+)", (WORKER / "runner.py").read_text()))
    assert used == set(protocol_members())


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("module", GENERIC)
def test_the_generic_worker_imports_no_backend_and_no_tt_metal_rule(module):
    found = imports(WORKER / module)
    assert not [n for n in found if "backends" in n or "tt_models" in n or "ttnn" in n or n.startswith("models")], found


def test_each_backend_states_its_own_prefill_rules():
    torch_backend = TorchBackend(None, None, lambda kind: False)
    ttnn_backend = TtnnBackend(resolve_mesh("N150", 1), {})
    qwen3_vl = type("Qwen3VLForConditionalGeneration", (), {})
    qwen2_5_vl = type("Qwen2_5_VLForConditionalGeneration", (), {})
    assert torch_backend.max_prefill_users(qwen3_vl, True) is None
    assert ttnn_backend.max_prefill_users(qwen3_vl, True) == 1  # it reads only its first user's images
    assert ttnn_backend.max_prefill_users(qwen3_vl, False) is None
    assert ttnn_backend.max_prefill_users(qwen2_5_vl, True) is None
    # tt-metal's vision classes return logits from prefill; the torch reference VLM mirrors them
    assert ttnn_backend.vision_prefill_samples_on_host and torch_backend.vision_prefill_samples_on_host


def _launch_decode_without_previous(self, model, sampling_params, *, tokens, start_pos, page_table, kv_cache,
                                    carried_rows=(), **inputs): ...


def _finish_decode_swapped(self, pending, model): ...


def _warmup_without_progress(self, model, kv_cache, config, page_table_width): ...


def _sampling_params_with_a_required_extra(self, batch, seeds, extra): ...


@pytest.mark.parametrize("wrong", [_launch_decode_without_previous, _finish_decode_swapped,
                                   _warmup_without_progress, _sampling_params_with_a_required_extra],
                         ids=lambda fn: fn.__name__.lstrip("_"))
def test_the_signature_check_refuses_a_method_the_runner_cannot_call(wrong):
    name = next(n for n in protocol_members() if wrong.__name__.lstrip("_").startswith(n))
    assert signature_problem(inspect.signature(getattr(DeviceBackend, name)), inspect.signature(wrong))

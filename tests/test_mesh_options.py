"""MESH_DEVICE, TT_VISIBLE_DEVICES, default fabrics and the `tt` options in both CLI forms:
everything a user can get wrong is refused before a device is touched, naming the allowed values."""
from __future__ import annotations

import json

import pytest

from ttserve.worker.planning.mesh import (FABRIC_CONFIGS, PRESETS, MeshError, MeshSpec, default_fabric, fabric_for,
                                 mesh_from_env, normalize_arch, parse_visible_devices, resolve_mesh)
from ttserve.worker.planning.options import (TT_OPTIONS, OptionError, TraceFlags,
                                    async_decode_allowed, check_model_options, device_sampling,
                                    parse_additional_config, split_additional_config,
                                    trace_flags, validate_additional_config)

# ---- meshes ------------------------------------------------------------------------------------

EXPECTED_PRESETS = {
    "N150": (1, 1, "wormhole", False), "N300": (1, 2, "wormhole", False),
    "N150x4": (1, 4, "wormhole", False), "T3K": (1, 8, "wormhole", False),
    "TG": (8, 4, "wormhole", True), "P100": (1, 1, "blackhole", False),
    "P150": (1, 1, "blackhole", False), "P150x2": (1, 2, "blackhole", False),
    "P150x4": (1, 4, "blackhole", False), "P150x8": (1, 8, "blackhole", False),
    "P300": (1, 2, "blackhole", False), "P300x2": (1, 4, "blackhole", False),
    "BH-Galaxy": (8, 4, "blackhole", True),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_every_preset_resolves_to_its_grid_and_arch(name):
    rows, cols, arch, galaxy = EXPECTED_PRESETS[name]
    assert resolve_mesh(name, 32) == MeshSpec(name, rows, cols, arch, galaxy)


def test_the_preset_table_is_exactly_the_documented_one():
    assert set(PRESETS) == set(EXPECTED_PRESETS)


def test_a_grid_string_is_accepted_in_its_usual_spellings():
    for text in ("(2,4)", "(2, 4)", " ( 2 , 4 ) ", "[2,4]"):
        spec = resolve_mesh(text, 8)
        assert spec.shape == (2, 4) and spec.num_devices == 8 and not spec.is_galaxy


def test_a_grid_takes_the_host_arch_and_a_32_chip_grid_is_a_galaxy():
    assert resolve_mesh("(1,2)", 2, arch="blackhole").arch == "blackhole"
    assert resolve_mesh("(1,2)", 2).arch == "wormhole"
    assert resolve_mesh("(8,4)", 32).is_galaxy
    assert not resolve_mesh("(8,4)", 32, is_galaxy=False).is_galaxy


def test_unset_mesh_device_is_one_row_of_every_available_device():
    assert resolve_mesh(None, 4).shape == (1, 4)
    assert resolve_mesh("", 2, arch="blackhole") == MeshSpec("(1,2)", 1, 2, "blackhole", False)
    assert resolve_mesh(None, 32, arch="wormhole_b0").is_galaxy


def test_unset_mesh_device_with_no_devices_fails():
    with pytest.raises(MeshError, match="no Tenstorrent devices"):
        resolve_mesh(None, 0)


def test_an_invalid_name_fails_listing_every_valid_one():
    with pytest.raises(MeshError) as e:
        resolve_mesh("N999", 8)
    message = str(e.value)
    assert "'N999'" in message and "(2,4)" in message
    for name in PRESETS:
        assert name in message


def test_a_wrongly_cased_name_gets_a_suggestion():
    with pytest.raises(MeshError, match="did you mean T3K"):
        resolve_mesh("t3k", 8)


@pytest.mark.parametrize("text", ["(0,4)", "(2,0)"])
def test_a_grid_with_an_empty_dimension_fails(text):
    with pytest.raises(MeshError, match="at least 1"):
        resolve_mesh(text, 8)


def test_a_grid_larger_than_the_available_devices_names_both_counts():
    with pytest.raises(MeshError) as e:
        resolve_mesh("T3K", 2)
    assert "needs 8 devices" in str(e.value) and "only 2 available" in str(e.value)
    with pytest.raises(MeshError, match=r"needs 12 devices \(3x4\) but this host has only 8"):
        resolve_mesh("(3,4)", 8)


def test_a_smaller_grid_than_the_host_is_allowed():
    assert resolve_mesh("N300", 8).num_devices == 2


def test_a_preset_of_the_other_arch_is_refused():
    with pytest.raises(MeshError, match="P150 is a Blackhole mesh, but this host's chips are Wormhole"):
        resolve_mesh("P150", 1, arch="wormhole_b0")
    with pytest.raises(MeshError, match="BH-Galaxy is a Blackhole mesh, but this host's chips are Wormhole"):
        resolve_mesh("BH-Galaxy", 32, arch="wormhole_b0")


def test_tg_is_the_galaxy_of_the_hosts_arch():
    # The plugin maps TG to the Galaxy grid with no arch check; its README serves Qwen3-32B on a
    # Blackhole Galaxy with MESH_DEVICE=TG.
    bh = resolve_mesh("TG", 32, arch="blackhole", is_galaxy=True)
    assert bh == MeshSpec("TG", 8, 4, "blackhole", True)
    assert resolve_mesh("TG", 32, arch="wormhole_b0") == MeshSpec("TG", 8, 4, "wormhole", True)
    # ... and gets the fabric the plugin gives a Blackhole Galaxy, with or without the cluster type.
    assert default_fabric(bh) == fabric_for(bh, None, "BLACKHOLE_GALAXY") == "FABRIC_2D_TORUS_XY"


def test_arch_names_from_ttnn_are_normalized():
    assert normalize_arch("wormhole_b0") == "wormhole"
    assert normalize_arch("BLACKHOLE") == "blackhole"
    assert normalize_arch("invalid") is None and normalize_arch(None) is None


def test_visible_devices_parse_as_a_comma_list_of_ids():
    assert parse_visible_devices("0,1, 3") == [0, 1, 3]
    assert parse_visible_devices(None) is None
    assert parse_visible_devices("  ") is None


@pytest.mark.parametrize("value", ["0,x", "-1", "0,,1", "1.5", "a"])
def test_invalid_visible_devices_fail_clearly(value):
    with pytest.raises(MeshError, match="TT_VISIBLE_DEVICES=.*non-negative integers"):
        parse_visible_devices(value)


def test_a_visible_device_named_twice_fails():
    with pytest.raises(MeshError, match="names device 1 twice"):
        parse_visible_devices("1,1")


def test_mesh_from_env_reads_both_variables_and_names_visible_devices_when_short():
    env = {"MESH_DEVICE": "N300", "TT_VISIBLE_DEVICES": "2,3"}
    assert mesh_from_env(env, 2).shape == (1, 2)
    with pytest.raises(MeshError, match=r"TT_VISIBLE_DEVICES=2,3"):
        mesh_from_env({"MESH_DEVICE": "T3K", "TT_VISIBLE_DEVICES": "2,3"}, 2)
    with pytest.raises(MeshError, match="not a device id"):
        mesh_from_env({"TT_VISIBLE_DEVICES": "first"}, 2)
    assert mesh_from_env({}, 4).shape == (1, 4)


# ---- fabric ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, fabric", [
    ("N150", None), ("P150", None), ("P100", None),
    ("N300", "FABRIC_1D"), ("T3K", "FABRIC_1D"), ("P150x4", "FABRIC_1D"), ("P300x2", "FABRIC_1D"),
    ("TG", "FABRIC_1D_RING"), ("BH-Galaxy", "FABRIC_2D_TORUS_XY"),
])
def test_default_fabric_per_mesh(name, fabric):
    assert default_fabric(resolve_mesh(name, 32)) == fabric


@pytest.mark.parametrize("cluster, fabric", [
    ("GALAXY", "FABRIC_1D_RING"),            # the 6U Wormhole Galaxy
    ("TG", "FABRIC_1D"),                     # the 4U one: the plugin gives the ring to GALAXY only
    ("BLACKHOLE_GALAXY", "FABRIC_2D_TORUS_XY"), ("T3K", "FABRIC_1D"),
])
def test_a_tg_mesh_takes_the_fabric_of_the_hosts_cluster_type(cluster, fabric):
    assert default_fabric(resolve_mesh("TG", 32), cluster) == fabric


def test_a_requested_fabric_overrides_the_default_but_never_on_one_device():
    t3k, n150 = resolve_mesh("T3K", 8), resolve_mesh("N150", 1)
    assert fabric_for(t3k, "FABRIC_2D") == "FABRIC_2D"
    assert fabric_for(t3k, None) == "FABRIC_1D"
    assert fabric_for(t3k, "DISABLED") is None
    assert fabric_for(n150, "FABRIC_2D_TORUS_XY") is None
    with pytest.raises(MeshError, match="FABRIC_1D_RING"):
        fabric_for(t3k, "FABRIC_3D")


def test_fabric_names_are_those_of_ttnn_0_81_1():
    assert set(FABRIC_CONFIGS) == {"DISABLED", "FABRIC_1D", "FABRIC_1D_RING", "FABRIC_1D_NEIGHBOR_EXCHANGE",
                                   "FABRIC_2D", "FABRIC_2D_TORUS_X", "FABRIC_2D_TORUS_Y",
                                   "FABRIC_2D_TORUS_XY", "CUSTOM"}


# ---- every tt option: good and bad values ------------------------------------------------------

GOOD = [
    ("sample_on_device_mode", "all", "all"), ("sample_on_device_mode", "decode_only", "decode_only"),
    ("trace_mode", "all", "all"), ("trace_mode", "decode_only", "decode_only"), ("trace_mode", "none", "none"),
    ("enable_model_warmup", True, True), ("enable_model_warmup", "false", False), ("enable_model_warmup", 0, False),
    ("trace_region_size", 220_000_000, 220_000_000), ("trace_region_size", "50m", 50_000_000),
    ("trace_region_size", "48M", 48 * 2**20), ("trace_region_size", "1000", 1000),
    ("trace_region_size", 5e7, 50_000_000),
    ("worker_l1_size", 1_344_544, 1_344_544), ("l1_small_size", "32K", 32768),
    ("fabric_config", "FABRIC_2D_TORUS_XY", "FABRIC_2D_TORUS_XY"), ("fabric_config", "DISABLED", "DISABLED"),
    ("fabric_reliability_mode", "RELAXED_INIT", "RELAXED_INIT"),
    ("fabric_reliability_mode", "STRICT_INIT", "STRICT_INIT"),
    ("dispatch_core_axis", "row", "row"), ("dispatch_core_axis", "col", "col"),
    ("always_compat_sampling", "True", True), ("always_compat_sampling", False, False),
    ("optimizations", "performance", "performance"), ("optimizations", "accuracy", "accuracy"),
    ("register_test_models", True, True), ("register_test_models", "false", False),
    ("config_pkl_dir", "/shared/tt", "/shared/tt"),
    ("env_passthrough", ["VLLM_*", "MESH_DEVICE"], ["VLLM_*", "MESH_DEVICE"]),
]

# The plugin's multi-rank launch (tt-run over MPI): recognised, and refused with what to do instead.
LAUNCH = {"rank_binding", "mpi_args", "extra_ttrun_args"}

BAD = [
    ("sample_on_device_mode", "decode", "choose one of all, decode_only"),
    ("sample_on_device_mode", True, "choose one of all, decode_only"),
    ("trace_mode", "prefill_only", "choose one of all, decode_only, none"),
    ("enable_model_warmup", "yes", "not a boolean"),
    ("enable_model_warmup", 2, "not a boolean"),
    ("trace_region_size", 0, "positive number of bytes"),
    ("trace_region_size", -5, "positive number of bytes"),
    ("trace_region_size", True, "positive number of bytes"),
    ("trace_region_size", "big", "positive number of bytes"),
    ("trace_region_size", "1.5M", "positive number of bytes"),
    ("worker_l1_size", None, "positive number of bytes"),
    ("l1_small_size", 1.5, "positive number of bytes"),
    ("fabric_config", "FABRIC_3D", "FABRIC_1D, FABRIC_1D_RING"),
    ("fabric_config", "fabric_1d", "choose one of DISABLED"),
    ("fabric_reliability_mode", "LAX", "choose one of STRICT_INIT, RELAXED_INIT"),
    ("dispatch_core_axis", "diagonal", "choose one of row, col"),
    ("always_compat_sampling", "maybe", "not a boolean"),
    ("optimizations", "speed", "choose one of performance, accuracy"),
    ("register_test_models", "yes", "not a boolean"),
    ("config_pkl_dir", "", "non-empty string"),
    ("env_passthrough", "VLLM_*", "list of environment-variable patterns"),
    ("rank_binding", "ranks.yaml", "pass each to the control plane with --worker"),
    ("mpi_args", "--map-by node", "one worker per host or submesh"),
    ("extra_ttrun_args", "--verbose", "start `ttserve worker` on each"),
]


def test_every_option_has_good_and_bad_cases():
    assert {k for k, _, _ in GOOD} | LAUNCH == set(TT_OPTIONS) == {k for k, _, _ in BAD}


@pytest.mark.parametrize("key, value, expected", GOOD)
def test_good_values_are_accepted_in_json_and_dotted_form(key, value, expected):
    assert parse_additional_config(json.dumps({"tt": {key: value}})) == {key: expected}
    text = value if isinstance(value, str) else json.dumps(value)
    rest, dotted = split_additional_config([f"--additional-config.tt.{key}", text])
    assert rest == [] and parse_additional_config(None, dotted) == {key: expected}


@pytest.mark.parametrize("key, value, allowed", BAD)
def test_bad_values_are_refused_naming_the_value_and_what_is_allowed(key, value, allowed):
    for text, dotted in ((json.dumps({"tt": {key: value}}), None), (None, {"tt": {key: value}})):
        with pytest.raises(OptionError) as e:
            parse_additional_config(text, dotted)
        assert f"tt.{key} = {value!r}" in str(e.value) and allowed in str(e.value)


def test_unknown_keys_are_refused_listing_the_known_ones_with_a_suggestion():
    for text, dotted in (('{"tt": {"trace_modes": "all"}}', None), (None, {"tt": {"trace_modes": "all"}})):
        with pytest.raises(OptionError) as e:
            parse_additional_config(text, dotted)
        message = str(e.value)
        assert "unknown option tt.trace_modes (did you mean tt.trace_mode?)" in message
        for key in TT_OPTIONS:
            assert key in message


def test_unknown_namespaces_and_malformed_objects_are_refused():
    with pytest.raises(OptionError, match="unknown namespace.*vllm"):
        parse_additional_config('{"vllm": {}}')
    with pytest.raises(OptionError, match="not valid JSON"):
        parse_additional_config("{tt: 1}")
    with pytest.raises(OptionError, match="must be a JSON object"):
        parse_additional_config("[1]")
    with pytest.raises(OptionError, match="must be an object of options"):
        parse_additional_config('{"tt": 3}')
    _, dotted = split_additional_config(["--additional-config.vllm.x", "1"])
    with pytest.raises(OptionError, match="unknown namespace"):
        parse_additional_config(None, dotted)


def test_no_options_at_all_is_empty():
    assert parse_additional_config(None) == {} and parse_additional_config("") == {}
    assert validate_additional_config({}) == {}


# ---- the dotted CLI form -------------------------------------------------------------------------

def test_dotted_flags_leave_argparse_the_rest_in_order():
    argv = ["--port", "1", "--additional-config.tt.trace_mode", "decode_only", "--model", "m",
            "--additional-config.tt.enable_model_warmup=false", "--additional-config", '{"tt": {}}']
    rest, dotted = split_additional_config(argv)
    assert rest == ["--port", "1", "--model", "m", "--additional-config", '{"tt": {}}']
    assert dotted == {"tt": {"trace_mode": "decode_only", "enable_model_warmup": False}}


def test_dotted_values_are_json_where_they_parse_else_strings():
    _, dotted = split_additional_config([
        "--additional-config.tt.trace_region_size", "220000000",
        "--additional-config.tt.always_compat_sampling=true",
        "--additional-config.tt.fabric_config", "FABRIC_1D_RING",
        "--additional_config.tt.dispatch_core_axis", '"col"'])
    assert dotted == {"tt": {"trace_region_size": 220_000_000, "always_compat_sampling": True,
                             "fabric_config": "FABRIC_1D_RING", "dispatch_core_axis": "col"}}


def test_a_value_with_an_equals_sign_or_dots_is_kept_whole():
    _, dotted = split_additional_config(["--additional-config.tt.fabric_config=A=B.C"])
    assert dotted == {"tt": {"fabric_config": "A=B.C"}}


def test_dotted_options_merge_over_json_key_by_key():
    _, dotted = split_additional_config(["--additional-config.tt.trace_mode", "none"])
    options = parse_additional_config('{"tt": {"trace_mode": "all", "optimizations": "accuracy"}}', dotted)
    assert options == {"trace_mode": "none", "optimizations": "accuracy"}


def test_a_whole_tt_object_may_be_given_dotted_and_merges_with_keys():
    _, dotted = split_additional_config(["--additional-config.tt", '{"trace_mode": "none"}',
                                         "--additional-config.tt.optimizations", "accuracy"])
    assert parse_additional_config(None, dotted) == {"trace_mode": "none", "optimizations": "accuracy"}


def test_the_last_of_a_repeated_dotted_key_wins():
    _, dotted = split_additional_config(["--additional-config.tt.trace_mode", "none",
                                         "--additional-config.tt.trace_mode", "all"])
    assert dotted == {"tt": {"trace_mode": "all"}}


def test_a_dotted_flag_without_a_value_or_key_fails():
    with pytest.raises(OptionError, match="needs a value"):
        split_additional_config(["--additional-config.tt.trace_mode"])
    with pytest.raises(OptionError, match="not of the form"):
        split_additional_config(["--additional-config.tt.", "x"])


def test_arguments_after_a_double_dash_are_left_alone():
    rest, dotted = split_additional_config(["--", "--additional-config.tt.trace_mode", "all"])
    assert rest == ["--", "--additional-config.tt.trace_mode", "all"] and dotted == {}


# ---- what the options mean together ------------------------------------------------------------

def test_trace_flags_per_step_kind():
    assert trace_flags({}) == TraceFlags(prefill=True, decode=True)
    assert trace_flags({"trace_mode": "all"}) == TraceFlags(True, True)
    assert trace_flags({"trace_mode": "decode_only"}) == TraceFlags(False, True)
    assert trace_flags({"trace_mode": "none"}) == TraceFlags(False, False)
    assert not trace_flags({"trace_mode": "none"}).any


def test_device_sampling_ceiling_per_step_kind():
    assert not device_sampling({}, "decode")
    assert device_sampling({"sample_on_device_mode": "all"}, "prefill")
    assert device_sampling({"sample_on_device_mode": "decode_only"}, "decode")
    assert not device_sampling({"sample_on_device_mode": "decode_only"}, "prefill")
    assert not device_sampling({"sample_on_device_mode": "all", "always_compat_sampling": True}, "decode")


def test_sampling_on_device_needs_a_model_that_declares_it():
    with pytest.raises(OptionError, match="TTFoo does not support sampling on the device"):
        check_model_options({"sample_on_device_mode": "all"}, {"supports_sample_on_device": False}, "TTFoo")
    assert check_model_options({"sample_on_device_mode": "all"}, {"supports_sample_on_device": True}, "X") == []


def test_options_without_effect_are_warned_about():
    warnings = check_model_options({"sample_on_device_mode": "all", "always_compat_sampling": True,
                                    "trace_mode": "none", "trace_region_size": 1},
                                   {"supports_sample_on_device": True}, "X")
    assert len(warnings) == 2
    assert "always_compat_sampling" in warnings[0] and "trace_region_size" in warnings[1]


def test_async_decode_needs_the_model_traced_decode_and_device_sampling():
    caps = {"supports_async_decode": True}
    good = {"sample_on_device_mode": "decode_only"}
    assert async_decode_allowed(good, caps)[0]
    assert async_decode_allowed({**good, "trace_mode": "decode_only"}, caps)[0]
    assert "supports_async_decode" in async_decode_allowed(good, {})[1]
    assert "traced decode" in async_decode_allowed({**good, "trace_mode": "none"}, caps)[1]
    assert "device sampling" in async_decode_allowed({}, caps)[1]
    assert "device sampling" in async_decode_allowed({**good, "always_compat_sampling": True}, caps)[1]

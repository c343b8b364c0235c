"""Every GPU family's plans fit its limits, through the plan inspector (mlx_flash.inspect).

For each CUDA family of kernels/families_cuda.txt and each Metal family, every kernel at every
head dim 1..512, each dtype and mask kind: the block sizes the backend would compile fit the
family's shared memory and threads (planned from the family's own rows; nothing shrinks a plan
at run time). Capabilities without a family (below sm_80) plan the fallback. Also: the
`python -m mlx_flash plan` command, and that no backend module keeps mutable module-level state.
"""
import ast
import importlib
import json
import pathlib
import subprocess
import sys

import pytest

from mlx_flash import inspect
from mlx_flash.backends import cuda_source
from mlx_flash.backends.cuda_source import Tuning

from child_env import child_env

HEAD_DIMS = range(1, 513)
CUDA_DTYPES = ("float16", "bfloat16")
MASKS = ("none", "causal", "bool", "additive")
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("family", [f.name for f in cuda_source.families()])
@pytest.mark.parametrize("tuning", [Tuning(), Tuning(wgmma_forward=False, wgmma_backward=False)],
                         ids=["table", "mma-sync-only"])
def test_cuda_family_plans_fit(family, tuning):
    fam = cuda_source.family_named(family)
    capability = min(fam.capabilities)
    seen = set()
    for head_dim in HEAD_DIMS:
        for dtype in CUDA_DTYPES:
            for mask in MASKS:
                for plan in inspect.plans("cuda", head_dim, dtype, mask, capability=capability, tuning=tuning):
                    assert plan.instruction in ("mma.sync", "wgmma"), plan
                    assert plan.fits, plan
                    assert plan.family in (family, family + "_wgmma"), plan
                    assert plan.shared_memory_limit == fam.shared_memory
                    seen.add(plan.instruction)
    # sm90 runs wgmma at every D (past 256 in column slices or groups); its mma.sync rows serve
    # with wgmma switched off (the second tuning)
    assert seen == ({"wgmma"} if fam.wgmma and tuning == Tuning() else {"mma.sync"})


def test_cuda_families_have_their_own_rows():
    """Each family plans from rows of its own name in blocks_cuda.txt (no shared or borrowed rows)."""
    from mlx_flash import planner
    table_families = {row.family for row in planner.load_table("cuda")}
    for family in cuda_source.families():
        assert family.name in table_families
        assert (family.name + "_wgmma" in table_families) == family.wgmma
    assert table_families <= {f.name for f in cuda_source.families()} | {
        f.name + "_wgmma" for f in cuda_source.families() if f.wgmma}


def test_cuda_family_limits():
    """The limits of the CUDA C++ Programming Guide's table (kernels/families_cuda.txt)."""
    limits = {f.name: (f.shared_memory, f.threads, f.wgmma) for f in cuda_source.families()}
    assert limits == {"sm80": (163 * 1024, 1024, False), "sm86": (99 * 1024, 1024, False),
                      "sm90": (227 * 1024, 1024, True), "sm100": (227 * 1024, 1024, False),
                      "sm120": (99 * 1024, 1024, False)}
    for capability, family in ((80, "sm80"), (87, "sm80"), (86, "sm86"), (89, "sm86"), (90, "sm90"),
                               (100, "sm100"), (120, "sm120"), (75, None), (70, None), (61, None)):
        found = cuda_source.family_of(capability)
        assert (found.name if found else None) == family


@pytest.mark.parametrize("capability", [75, 70, 60])
def test_cuda_below_sm80_plans_the_fallback(capability):
    for head_dim in (1, 64, 128, 512):
        for plan in inspect.plans("cuda", head_dim, "bfloat16", capability=capability):
            assert plan.instruction == "fallback" and f"compute capability {capability}" in plan.name


def test_cuda_unsupported_calls_plan_the_fallback():
    assert {p.instruction for p in inspect.plans("cuda", 64, "float32", capability=90)} == {"fallback"}
    assert {p.instruction for p in inspect.plans("cuda", 513, "bfloat16", capability=86)} == {"fallback"}


def test_cuda_rows_past_the_limit_are_an_error():
    """A row too large for its family is reported, not shrunk."""
    spec = inspect.make_spec(512, "bfloat16")
    too_big = Tuning(blocks={"forward": (128, 128, 256, 8)})
    with pytest.raises(ValueError, match="shared memory, over family sm86"):
        cuda_source.make_variant("forward", spec, None, cuda_source.family_named("sm86"), too_big)


def test_cuda_masked_keys_option():
    """A wgmma row's masked_t<N> / window_t<N> / softcap_t<N> give calls with an array mask / a
    window / a softcap T = N (the smallest with several); other calls keep the row's T."""
    import dataclasses

    import mlx.core as mx
    from mlx_flash import planner

    sm90 = cuda_source.family_named("sm90")

    def keys(mask, table=None, head_dim=160, window=None, softcap=None):
        mask_dtype = {"bool": mx.bool_, "additive": mx.bfloat16}.get(mask)
        spec = inspect.make_spec(head_dim, "bfloat16", mask)
        if window is not None:  # an array mask and a window together
            spec = dataclasses.replace(spec, window=window)
        if softcap is not None:
            spec = dataclasses.replace(spec, softcap=softcap)
        return cuda_source.make_variant("forward", spec, mask_dtype, sm90, Tuning(), True, table).traversal_block

    assert [keys(m) for m in ("none", "causal", "window", "bool", "additive")] == [96, 96, 96, 64, 64]
    assert [keys(m, head_dim=256) for m in ("none", "causal", "window", "bool", "additive")] == [80, 80, 64, 64, 64]
    assert [keys(m, head_dim=128) for m in ("none", "causal", "bool", "additive")] == [128, 128, 96, 96]
    assert [keys(m, head_dim=64) for m in ("none", "causal", "window", "bool", "additive")] == [128, 128, 96, 64, 64]
    assert keys("none", head_dim=64, softcap=30.0) == keys("causal", head_dim=40, softcap=30.0) == 96
    assert keys("bool", head_dim=64, softcap=30.0) == 64 and keys("none", softcap=30.0) == 96  # D=160: no option
    shipped = planner.shipped_table("cuda")

    def with_options(options):
        rows = tuple(dataclasses.replace(r, cached=frozenset(options))
                     if (r.kernel, r.family, r.max_head_dim) == ("forward", "sm90_wgmma", 192) else r
                     for r in shipped.rows)
        return planner.Table("cuda", "test", rows)

    assert keys("bool", with_options(())) == keys("none", with_options(())) == 96  # a row without the option
    assert keys("bool", with_options({"masked_t32"})) == 32 and keys("none", with_options({"masked_t32"})) == 96
    both = with_options({"masked_t48", "window_t32"})
    assert [keys(m, both) for m in ("none", "window", "bool")] == [96, 32, 48]
    assert keys("bool", both, window=(8, 0)) == 32 and keys("bool", with_options({"masked_t48"}), window=(8, 0)) == 48
    capped = with_options({"masked_t48", "softcap_t64"})
    assert [keys("none", capped), keys("none", capped, softcap=5.0), keys("bool", capped, softcap=5.0)] == [96, 64, 48]
    for bad, name in (({"masked_tx"}, "masked_t"), ({"masked_t32", "masked_t48"}, "masked_t"), ({"window_t"}, "window_t"),
                      ({"softcap_t1x"}, "softcap_t")):
        with pytest.raises(ValueError, match=name):
            keys("bool", with_options(bad))
    with pytest.raises(ValueError, match="multiple of 16"):
        keys("bool", with_options({"masked_t40"}))


def _sm90_variant(kernel, mask, tuning, table, head_dim, **spec_fields):
    """The wgmma variant the sm90 family plans for a bf16 call (a real sm_90: wgmma kernels) with
    `mask` and the spec fields given (softcap, window), from `table` (None: the shipped one)."""
    import dataclasses

    import mlx.core as mx

    mask_dtype = {"bool": mx.bool_, "additive": mx.bfloat16}.get(mask)
    spec = dataclasses.replace(inspect.make_spec(head_dim, "bfloat16", mask), **spec_fields)
    return cuda_source.make_variant(kernel, spec, mask_dtype, cuda_source.family_named("sm90"), tuning, True, table)


def test_scale_fold_by_row_option_or_tuning():
    """The wgmma forward's scale fold (cuda_source.SCALE_FOLD) comes from its row's options or a
    Tuning, only where the kernel has the path it changes (no array mask, no softcap), and is part
    of the variant's name and key; the shipped table turns it on where it was measured faster (D <= 256)."""
    import dataclasses

    from mlx_flash import planner
    shipped = planner.shipped_table("cuda")

    def variant(mask="none", tuning=Tuning(), table=None, kernel="forward", head_dim=128, softcap=None):
        return _sm90_variant(kernel, mask, tuning, table, head_dim, softcap=softcap)

    folding = {(r.kernel, r.family, r.max_head_dim) for r in shipped.rows if cuda_source.SCALE_FOLD in r.cached}
    assert folding == {("forward", "sm90_wgmma", d) for d in (64, 128, 192, 256)}  # where it was faster
    assert all(variant(m, head_dim=d).scale_fold for m in ("none", "causal") for d in (64, 128, 160, 256))
    assert not any(variant(m, head_dim=d).scale_fold for m in ("none", "causal") for d in (257, 512))
    off, on = Tuning(scale_fold=False), Tuning(scale_fold=True)
    assert not variant("none", off).scale_fold and not variant("causal", off, head_dim=64).scale_fold
    assert variant("none", on, head_dim=512).scale_fold and variant("causal", on, head_dim=512).scale_fold
    assert variant("none").name == variant("none", off).name + "f"  # the flags: pingpong, fold
    assert variant("none").name.endswith("_pf") and variant("none", off) != variant("none")
    assert variant("none").constants()["scale_fold"] is True
    assert not variant("none", off).constants()["scale_fold"]
    # only where the kernel has the path it changes
    assert not any((variant("bool").scale_fold, variant("additive", on).scale_fold,
                    variant("none", softcap=20.0).scale_fold,
                    variant("none", on, kernel="backward_query").scale_fold,
                    variant("none", Tuning(scale_fold=True, wgmma_forward=False)).scale_fold))
    # a table's row option, row by row
    rows = tuple(dataclasses.replace(r, cached=r.cached - {cuda_source.SCALE_FOLD})
                 if (r.kernel, r.family, r.max_head_dim) == ("forward", "sm90_wgmma", 128) else r
                 for r in shipped.rows)
    table = planner.Table("cuda", "test", rows)
    assert not variant("none", table=table).scale_fold and not variant("causal", table=table).scale_fold
    assert variant("none", on, table).scale_fold
    assert variant("none", table=table, head_dim=64).scale_fold  # another row


def test_row_sums_by_mma_by_row_option_or_tuning():
    """The wgmma forward's row sums by the tensor cores (cuda_source.MMA_SUMS) come from its row's
    options (for calls without an array mask, window or softcap) or a Tuning, only where O is one
    64-column V panel (D = 49..64, so the ones sit in the next panel), and are part of the
    variant's name, key, shared memory and wgmma widths; the shipped table has them on its D <= 64
    forward row."""
    import dataclasses

    from mlx_flash import planner
    shipped = planner.shipped_table("cuda")

    def variant(mask="none", tuning=Tuning(), table=None, kernel="forward", head_dim=64):
        return _sm90_variant(kernel, mask, tuning, table, head_dim)

    on, off = Tuning(mma_sums=True), Tuning(mma_sums=False)
    summing = {(r.kernel, r.family, r.max_head_dim) for r in shipped.rows if cuda_source.MMA_SUMS in r.cached}
    assert summing == {("forward", "sm90_wgmma", 64)}  # where it was measured faster
    assert variant("none").mma_sums and variant("causal").mma_sums and variant("none", head_dim=50).mma_sums
    assert not any((variant("bool").mma_sums, variant("additive").mma_sums, variant("none", head_dim=48).mma_sums))
    # nor calls with a window or softcap (not measured with the option), unless forced
    windowed = _sm90_variant("forward", "causal", Tuning(), None, 64, window=(64, 0))
    capped = _sm90_variant("forward", "none", Tuning(), None, 64, softcap=20.0)
    assert not windowed.mma_sums and not capped.mma_sums
    assert _sm90_variant("forward", "none", on, None, 64, softcap=20.0).mma_sums
    assert all(variant(m, on, head_dim=d).mma_sums for m in ("none", "causal", "bool") for d in (49, 50, 64))
    assert not any(variant("none", on, head_dim=d).mma_sums for d in (32, 48, 65, 128, 512))
    assert not any(variant("none", on, kernel=k).mma_sums for k in ("backward_query", "backward_key_value"))
    assert not variant("none", off).mma_sums
    summed, plain = variant("none", on), variant("none", off)
    assert summed.name == plain.name + "l" and summed != plain
    assert summed.shared_memory - plain.shared_memory == 2 * plain.traversal_block * 128  # a ones panel a V stage
    assert summed.constants()["mma_sums"] is True and plain.constants()["mma_sums"] is False
    header = cuda_source.source(summed)[0]
    assert "struct Wgmma<72, __nv_bfloat16>" in header
    assert "struct Wgmma<72," not in cuda_source.source(plain)[0]
    # a table's row option
    rows = tuple(dataclasses.replace(r, cached=r.cached - {cuda_source.MMA_SUMS}) for r in shipped.rows)
    table = planner.Table("cuda", "test", rows)
    assert not variant("none", table=table).mma_sums and variant("none", on, table).mma_sums


def test_roles_by_row_option_or_tuning():
    """The wgmma dK/dV kernel's split by role past D = 256 (cuda_source.ROLES) comes from its row's
    options or a Tuning, only for the two CTAs of column groups a key block (D = 257..512) and
    calls without a causal mask or window, and is part of the variant's name and key; the shipped
    table has it on the D = 385..512 row (measured faster at D = 448 and 512, a tie up to 384)."""
    from mlx_flash import planner
    shipped = planner.shipped_table("cuda")

    def variant(mask="none", tuning=Tuning(), table=None, kernel="backward_key_value", head_dim=512, window=None):
        return _sm90_variant(kernel, mask, tuning, table, head_dim, window=window)

    rows = {(r.kernel, r.family, r.max_head_dim) for r in shipped.rows if cuda_source.ROLES in r.cached}
    assert rows == {("backward_key_value", "sm90_wgmma", 512)}
    assert all(variant(m, head_dim=d).roles for m in ("none", "bool", "additive") for d in (385, 448, 512))
    assert not any(variant("none", head_dim=d).roles for d in (128, 256, 257, 320, 384))
    assert not variant("causal").roles and not variant("none", window=(64, 64)).roles
    off, on = Tuning(roles=False), Tuning(roles=True)
    assert not variant("none", off).roles and variant("none", on, head_dim=300).roles
    assert not any((variant("none", on, head_dim=256).roles, variant("causal", on).roles,
                    variant("none", on, kernel="backward_query").roles, variant("none", on, kernel="forward").roles,
                    variant("none", Tuning(roles=True, wgmma_backward=False)).roles))
    assert variant("none").name == variant("none", off).name.replace("_x", "_") + "r"
    assert variant("none").constants()["roles"] is True and variant("none", off).constants()["roles"] is False
    assert variant("none") != variant("none", off)


@pytest.mark.parametrize("family", ["m1", "m3"])
def test_metal_family_plans_fit(family):
    for head_dim in range(1, 513, 7):
        for dtype in ("float32", "float16", "bfloat16"):
            for plan in inspect.plans("metal", head_dim, dtype, "causal", family=family):
                assert plan.instruction == "simdgroup_matrix" and plan.fits, plan


def _run_plan(*args):
    env = child_env()
    env.pop("MLX_FLASH_CUDA_CAPABILITY", None)
    return subprocess.run([sys.executable, "-m", "mlx_flash", "plan", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_plan_command():
    result = _run_plan("--backend", "cuda", "--capability", "86", "--head-dim", "128", "--dtype", "bfloat16",
                       "--mask", "causal", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert rows == [p.as_dict() for p in inspect.plans("cuda", 128, "bfloat16", "causal", capability=86)]
    assert [r["instruction"] for r in rows] == ["mma.sync"] * 3 and all(r["fits"] for r in rows)
    text = _run_plan("--backend", "cuda", "--capability", "90", "--head-dim", "128").stdout
    assert "wgmma" in text and "232448" in text
    text = _run_plan("--backend", "metal", "--family", "m1", "--head-dim", "64", "--dtype", "float32").stdout
    assert "simdgroup_matrix" in text
    assert "fallback" in _run_plan("--backend", "cuda", "--capability", "75", "--head-dim", "64").stdout
    bad = _run_plan("--backend", "cuda", "--head-dim", "0")
    assert bad.returncode == 2 and "--head-dim" in bad.stderr


def test_plan_command_head_splits():
    """--group / --kv-heads / --batch / --sm-count: how many dK/dV CTAs share a kv head's query heads
    (the table's head_splits_* on sm90), and the kernel that splits them in the plan."""
    common = ("--backend", "cuda", "--capability", "90", "--head-dim", "128", "--mask", "causal", "--group", "4",
              "--kv-heads", "4", "--sm-count", "132")
    text = _run_plan(*common, "--seq-len", "2048").stdout
    assert "dK/dV head splits: 2 CTAs share each kv head's query heads, 2 + 2" in text
    group7 = _run_plan(*common[:9], "7", *common[10:], "--seq-len", "2048").stdout  # Qwen2.5-7B's 28 / 4
    assert "dK/dV head splits: 2 CTAs share each kv head's query heads, 4 + 3" in group7
    assert "dK/dV head splits: none" in _run_plan(*common, "--seq-len", "2048", "--batch", "2").stdout
    assert "dK/dV head splits: none" in _run_plan(*common, "--seq-len", "8192").stdout
    assert "head splits" not in _run_plan(*common[:-6], "--seq-len", "2048").stdout  # MHA
    rows = inspect.plans("cuda", 128, "bfloat16", "causal", capability=90, q_len=2048, group=4, kv_heads=4,
                         sm_count=132)
    assert rows[2].name.endswith("_ch") and not rows[0].name.endswith("h")  # the head_split variant
    assert inspect.plans("cuda", 128, "bfloat16", "causal", capability=90, q_len=2048, group=4, kv_heads=4,
                         batch=2, sm_count=132)[2].name.endswith("_c")
    with pytest.raises(ValueError, match="kv_heads"):
        inspect.plans("cuda", 128, kv_heads=0)


BACKEND_MODULES = sorted(p.stem for p in (ROOT / "mlx_flash" / "backends").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", ["__init__"] + BACKEND_MODULES)
def test_backend_modules_keep_no_mutable_state(name):
    """No module-level switch in mlx_flash/backends: no mutable containers among a module's
    globals, no `global` statement, and nothing in the repository assigns a backend module's
    attribute (the old tuning hooks); tuning is a Tuning value, the emulator a kernel factory."""
    module = importlib.import_module("mlx_flash.backends" + ("" if name == "__init__" else "." + name))
    for attr, value in vars(module).items():
        if not attr.startswith("__"):
            assert not isinstance(value, (dict, list, set, bytearray)), f"{module.__name__}.{attr} is a mutable {type(value).__name__}"
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], f"{module.__name__} rebinds module state"


def test_nothing_assigns_backend_module_attributes():
    names = {"cuda", "metal", "cuda_source", "metal_source", "common", "cuda_emulator", "mlx_ops"}
    offenders = []
    for path in list((ROOT / "mlx_flash").rglob("*.py")) + list((ROOT / "tests").rglob("*.py")) + \
            list((ROOT / "benchmarks").glob("*.py")):
        if path.name == "gpu_check.py":  # exploration script, being retired
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id in names:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_no_test_imports_gpu_check():
    for path in (ROOT / "tests").rglob("*.py"):
        assert "gpu_check" not in path.read_text() or path.name == "test_plans.py", path

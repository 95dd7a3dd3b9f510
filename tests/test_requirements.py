"""The import-time check of the MLX and mlx-lm versions (`dflash_mlx.requirements`)."""

import tomllib
from pathlib import Path

import pytest

from dflash_mlx import requirements


def versions(**found):
    return lambda name: found.get(name.replace("-", "_"))


MACOS = "darwin"


def test_an_old_mlx_lm_is_named_with_the_command_that_upgrades_it():
    with pytest.raises(ImportError) as e:
        requirements.check(versions(mlx="0.32.4", mlx_lm="0.28.4"), MACOS)
    assert str(e.value) == "dflash-mlx needs mlx-lm >= 0.32.2 (found 0.28.4): pip install -U 'mlx-lm>=0.32.2'"


def test_both_old_are_named_in_one_line():
    with pytest.raises(ImportError) as e:
        requirements.check(versions(mlx="0.29.0", mlx_lm="0.31.3"), MACOS)
    message = str(e.value)
    assert "\n" not in message
    assert "mlx >= 0.32.4 (found 0.29.0)" in message and "mlx-lm >= 0.32.2 (found 0.31.3)" in message
    assert message.endswith("pip install -U 'mlx>=0.32.4' 'mlx-lm>=0.32.2'")


@pytest.mark.parametrize("builds,wanted", [(dict(mlx_cpu="0.29.0"), "mlx[cpu]"), (dict(), "mlx[cpu]"),
                                            (dict(mlx_cuda_13="0.30.0"), "mlx[cuda13]"),
                                            (dict(mlx_cuda_12="0.30.0"), "mlx[cuda12]"),
                                            (dict(mlx_cuda="0.30.0"), "mlx[cuda]")])
def test_on_linux_the_upgrade_names_the_backend_build_held(builds, wanted):
    with pytest.raises(ImportError) as e:
        requirements.check(versions(mlx="0.30.0", mlx_lm="0.32.2", **builds), "linux")
    assert str(e.value).endswith(f"pip install -U '{wanted}>=0.32.4'")


@pytest.mark.parametrize("found", [dict(mlx="0.32.4", mlx_lm="0.32.2"), dict(mlx="0.33.0.dev20270101", mlx_lm="1.0"),
                                   dict(), dict(mlx="local-build", mlx_lm="0.32.2")])
def test_new_enough_unknown_or_unreadable_versions_pass(found):
    requirements.check(versions(**found))  # (no metadata, or a version PEP 440 cannot read: not refused)


def test_this_environment_passes_and_the_bounds_are_pyprojects():
    requirements.check()

    deps = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    for name, least in requirements.MINIMUM.items():
        assert f"{name}>={least}" in deps["dependencies"]



def test_no_python_we_admit_is_refused_by_the_oldest_mlx_lm_we_admit():
    """(pip on such a Python fails on mlx-lm: "No matching distribution found for mlx-lm>=...")"""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    if metadata.version("mlx-lm") != requirements.MINIMUM["mlx-lm"]:
        pytest.skip("the installed mlx-lm is not the oldest we admit: its metadata says nothing of that one")
    ours = SpecifierSet(tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
                        ["project"]["requires-python"])
    theirs = SpecifierSet(metadata.metadata("mlx-lm")["Requires-Python"])
    assert all(v in theirs for v in (f"3.{minor}" for minor in range(8, 16)) if v in ours)
